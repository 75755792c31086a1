// Each test runs in its own process (ctest), so BLIS starts fresh in each:
// it reads BLIS_ARCH_TYPE and BLIS_NUM_THREADS once, on its first product.
// The probes fork, so a test runs no product before them.

#include "common/blas_kernel_probe.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/blas_library.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/hand_matmul.h"
#include "tests/temp_dir.h"

namespace himoe {
namespace {

using ::testing::HasSubstr;
using test_util::ExpectMatmulMatchesHandSums;

KernelProbe Probe(const std::string& name, double gflops, const std::string& error = "") {
  KernelProbe p;
  p.name = name;
  p.gflops = gflops;
  p.error = error;
  return p;
}

// The fastest kernel set wins only if it ran and matched the reference.
TEST(BlasKernelProbeTest, TheFastestCorrectKernelsWin) {
  EXPECT_EQ(FastestCorrectKernels({Probe("skx", 250), Probe("zen3", 130), Probe("generic", 40)}),
            "skx");
  EXPECT_EQ(FastestCorrectKernels({Probe("skx", 0, "killed by signal 4"), Probe("zen3", 130),
                                   Probe("haswell", 132), Probe("generic", 40)}),
            "haswell");
  EXPECT_EQ(FastestCorrectKernels({Probe("skx", 300, "wrong result: max error 12"),
                                   Probe("generic", 40)}),
            "generic");
  EXPECT_EQ(FastestCorrectKernels({Probe("zen3", 130), Probe("haswell", 130)}), "zen3");
  EXPECT_EQ(FastestCorrectKernels({Probe("skx", 0, "timed out")}), "");
  EXPECT_EQ(FastestCorrectKernels({}), "");
}

// More BLAS threads are kept unless one thread was faster.
TEST(BlasKernelProbeTest, BlasThreadsStayUnlessOneIsFaster) {
  EXPECT_EQ(BlisThreadsFor(2, 40, 265), 2);
  EXPECT_EQ(BlisThreadsFor(2, 265, 40), 1);
  EXPECT_EQ(BlisThreadsFor(4, 100, 100), 4);
  const BlisThreadChoice one = SelectBlisThreads(1);
  EXPECT_EQ(one.blas_threads, 1);
  EXPECT_TRUE(one.gflops.empty());
}

// Without BLIS_ARCH_TYPE, BLIS's own choice is kept where it knows the CPU,
// else the probe's; every probed kernel set that ran is reported with a rate,
// and the choice is exported for child processes.
TEST(BlasKernelProbeTest, ProbedKernelsAreNotGeneric) {
  if (!BlasLibrary::Find().blis()) GTEST_SKIP() << "the system BLAS is not BLIS";
  unsetenv("BLIS_ARCH_TYPE");
  const BlisKernelChoice choice = SelectBlisKernels(/*probe=*/true, /*cache_file=*/"");
  ASSERT_THAT(choice.source, ::testing::AnyOf("library", "probed"));
  if (CandidateBlisKernels().size() > 1) {
    EXPECT_NE(choice.kernels, "generic");
  }
  for (const KernelProbe& p : choice.probes) {
    EXPECT_TRUE(p.error.empty() ? p.gflops > 0 : p.gflops == 0) << p.name << ": " << p.error;
  }
  if (choice.source == "probed") {
    EXPECT_EQ(choice.kernels, FastestCorrectKernels(choice.probes));
    ASSERT_NE(getenv("BLIS_ARCH_TYPE"), nullptr);
    EXPECT_EQ(BlisKernelName(getenv("BLIS_ARCH_TYPE")), choice.kernels);
  }
  ExpectMatmulMatchesHandSums();
}

// The probe's choice is cached for this CPU and BLIS: the next set-up (the
// next start of a service) takes it without probing. An entry of another CPU
// or BLIS, or naming kernels this BLIS lacks, is not trusted.
TEST(BlasKernelProbeTest, TheKernelChoiceIsCachedForThisCpuAndBlis) {
  if (!BlasLibrary::Find().blis()) GTEST_SKIP() << "the system BLAS is not BLIS";
  unsetenv("BLIS_ARCH_TYPE");
  const test_util::TempDir temp("himoe_kernel_cache");
  const std::string cache_file = temp.path() + "/sub/blis-kernels";
  const BlisKernelChoice first = SelectBlisKernels(/*probe=*/true, cache_file);
  if (first.source == "library") {
    GTEST_SKIP() << "BLIS knows this CPU (kernels '" << first.kernels
                 << "'): nothing is probed, so nothing is cached";
  }
  ASSERT_EQ(first.source, "probed");
  const std::vector<std::string> lines =
      absl::StrSplit(test_util::ReadTextFile(cache_file), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u);
  const std::string key = lines[0];
  EXPECT_THAT(key, HasSubstr("model name="));
  EXPECT_THAT(key, HasSubstr("| blis OK generic "));
  EXPECT_EQ(lines[1], first.kernels);
  const std::string exported = getenv("BLIS_ARCH_TYPE");

  unsetenv("BLIS_ARCH_TYPE");
  const BlisKernelChoice cached = SelectBlisKernels(/*probe=*/true, cache_file);
  EXPECT_EQ(cached.source, "cached");
  EXPECT_EQ(cached.kernels, first.kernels);
  EXPECT_TRUE(cached.probes.empty());
  ASSERT_NE(getenv("BLIS_ARCH_TYPE"), nullptr);
  EXPECT_EQ(getenv("BLIS_ARCH_TYPE"), exported);

  for (const std::string& stale : {absl::StrCat("cpu another one\n", first.kernels, "\n"),
                                   absl::StrCat(key, "\nno-such-kernels\n")}) {
    SCOPED_TRACE(stale);
    std::ofstream(cache_file, std::ios::trunc) << stale;
    unsetenv("BLIS_ARCH_TYPE");
    const BlisKernelChoice again = SelectBlisKernels(/*probe=*/true, cache_file);
    EXPECT_EQ(again.source, "probed");
    EXPECT_FALSE(again.probes.empty());
    EXPECT_EQ(test_util::ReadTextFile(cache_file), absl::StrCat(key, "\n", again.kernels, "\n"));
  }
  ExpectMatmulMatchesHandSums();
}

// Without `probe`, BLIS's own choice stays, even 'generic', and nothing is
// timed or cached.
TEST(BlasKernelProbeTest, WithoutTheProbeBlisChooses) {
  if (!BlasLibrary::Find().blis()) GTEST_SKIP() << "the system BLAS is not BLIS";
  unsetenv("BLIS_ARCH_TYPE");
  const test_util::TempDir temp("himoe_kernel_cache");
  const BlisKernelChoice choice = SelectBlisKernels(/*probe=*/false, temp.Sub("blis-kernels"));
  EXPECT_EQ(choice.source, "library");
  EXPECT_FALSE(choice.kernels.empty());
  EXPECT_TRUE(choice.probes.empty());
  EXPECT_EQ(test_util::ReadTextFile(temp.Sub("blis-kernels")), "");
}

// BLIS 0.9 reads a number: 'generic' is the last of its kernel sets.
TEST(BlasKernelProbeTest, ABlisArchTypeIsNamed) {
  if (!BlasLibrary::Find().blis()) GTEST_SKIP() << "the system BLAS is not BLIS";
  EXPECT_EQ(BlisKernelName("25"), "generic");
  EXPECT_EQ(BlisKernelName("999"), "999");
}

}  // namespace
}  // namespace himoe
