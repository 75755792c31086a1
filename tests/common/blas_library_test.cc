#include "common/blas_library.h"

#include <algorithm>
#include <string>
#include <vector>

#include "common/probe_process.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace himoe {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;

TEST(BlasLibraryTest, CandidatesFollowTheCpuFlags) {
  const std::vector<std::string> names = CandidateBlisKernels();
  ASSERT_FALSE(names.empty());
  EXPECT_EQ(names.back(), "generic");
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  EXPECT_EQ(avx512, std::find(names.begin(), names.end(), "skx") != names.end());
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  EXPECT_EQ(avx2, std::find(names.begin(), names.end(), "haswell") != names.end());
}

// The names a user reads in the log, for the libraries LibTorch may run its
// GEMMs on: Debian's (loaded), pip's (linked into LibTorch: no libblas.so is
// loaded, and LibTorch's build names it).
TEST(BlasLibraryTest, TheBlasIsNamedLoadedOrInsideLibTorch) {
  EXPECT_EQ(BlasDisplayName("/usr/lib/x86_64-linux-gnu/blis-openmp/libblas.so.3", false, ""),
            "BLIS");
  EXPECT_EQ(BlasDisplayName("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3", false, ""),
            "OpenBLAS");
  EXPECT_EQ(BlasDisplayName("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3", false, ""),
            "reference BLAS");
  EXPECT_EQ(BlasDisplayName("/opt/lib/libblas.so.3", false, ""), "/opt/lib/libblas.so.3");
  EXPECT_EQ(BlasDisplayName("", true, "  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release"),
            "MKL (inside LibTorch)");
  EXPECT_EQ(BlasDisplayName("", false, "  - Build settings: BLAS_INFO=open, BUILD_TYPE=Release"),
            "open (inside LibTorch)");
  // Debian's LibTorch: BLAS_INFO=generic is the libblas.so.3 interface.
  EXPECT_EQ(BlasDisplayName("", false, "  - Build settings: BLAS_INFO=generic, BUILD_TYPE=Release"),
            "no BLAS library (LibTorch's own GEMM)");
  EXPECT_EQ(BlasDisplayName("", false, ""), "no BLAS library (LibTorch's own GEMM)");
}

// A BLIS build is known by its folder, and named with its threading.
TEST(BlasLibraryTest, BlisBuildsAreKnownByTheirFolder) {
  for (const char* threading : {"openmp", "pthread", "serial"}) {
    const BlasLibrary lib = BlasLibrary::AtPath(
        std::string("/usr/lib/x86_64-linux-gnu/blis-") + threading + "/libblas.so.3");
    EXPECT_TRUE(lib.blis()) << threading;
    EXPECT_EQ(lib.blis_threading, threading);
    EXPECT_EQ(lib.Name(), std::string("BLIS (") + threading + ")");
  }
  const BlasLibrary openblas =
      BlasLibrary::AtPath("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3");
  EXPECT_FALSE(openblas.blis());
  EXPECT_EQ(openblas.Name(), "OpenBLAS");
  EXPECT_FALSE(BlasLibrary::AtPath("").blis());
}

// The library loaded here is the one named: BLIS exactly when its path is a
// BLIS build's.
TEST(BlasLibraryTest, TheLoadedLibraryIsFound) {
  const BlasLibrary lib = BlasLibrary::Find();
  EXPECT_EQ(lib.blis(), lib.path.find("/blis-") != std::string::npos) << lib.path;
}

TEST(BlasLibraryTest, TheKernelTableIsParsed) {
  const auto table = ParseBlisKernelTable("OK generic skx=3 zen3=6 haswell=7 generic=25");
  ASSERT_TRUE(table.has_value());
  EXPECT_EQ(table->choice, "generic");
  EXPECT_THAT(table->ids, ElementsAre(Pair("generic", "25"), Pair("haswell", "7"),
                                      Pair("skx", "3"), Pair("zen3", "6")));
  EXPECT_FALSE(ParseBlisKernelTable("ERR libblis.so.4 not found").has_value());
  EXPECT_FALSE(ParseBlisKernelTable("OK").has_value());
  EXPECT_FALSE(ParseBlisKernelTable("").has_value());
}

// BLIS's own table, asked in a child: its choice is one of its kernel sets,
// and 'generic' is the last of them.
TEST(BlasLibraryTest, BlisListsItsKernelSets) {
  if (!BlasLibrary::Find().blis()) GTEST_SKIP() << "the system BLAS is not BLIS";
  const std::string answer = RunInChild({}, [] { return BlisKernelSets(); });
  const auto table = ParseBlisKernelTable(answer);
  ASSERT_TRUE(table.has_value()) << answer;
  EXPECT_EQ(table->ids.count(table->choice), 1u) << answer;
  ASSERT_EQ(table->ids.count("generic"), 1u) << answer;
  for (const auto& [name, id] : table->ids) {
    EXPECT_LE(std::stoi(id), std::stoi(table->ids.at("generic"))) << name;
  }
}

}  // namespace
}  // namespace himoe
