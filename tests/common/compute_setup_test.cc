// Each test runs in its own process (ctest), so BLIS starts fresh in each:
// it reads BLIS_ARCH_TYPE and BLIS_NUM_THREADS once, on its first product.

#include "common/compute_setup.h"

#include <malloc.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/linear.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/temp_dir.h"

namespace himoe {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

// c = a @ b checked entry by entry against double sums.
void ExpectMatmulMatchesHandSums() {
  const at::Tensor a = at::randn({96, 64});
  const at::Tensor b = at::randn({64, 80});
  const at::Tensor c = at::mm(a, b);
  const auto ac = a.accessor<float, 2>();
  const auto bc = b.accessor<float, 2>();
  const auto cc = c.accessor<float, 2>();
  double worst = 0;
  for (int i = 0; i < 96; ++i) {
    for (int j = 0; j < 80; ++j) {
      double sum = 0;
      for (int k = 0; k < 64; ++k) sum += static_cast<double>(ac[i][k]) * bc[k][j];
      worst = std::max(worst, std::abs(sum - cc[i][j]));
    }
  }
  EXPECT_LT(worst, 1e-3);
}

bool IsBlis(const ComputeSetup& setup) { return setup.blas.rfind("BLIS", 0) == 0; }

TEST(ComputeSetupTest, CandidatesFollowTheCpuFlags) {
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
// GEMMs on: Debian's (loaded), pip's (linked into LibTorch, as on the H100
// of 2026-11-27, which logged "no BLAS").
TEST(ComputeSetupTest, TheBlasIsNamedLoadedOrInsideLibTorch) {
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

TEST(ComputeSetupTest, VectorPeakScalesWithThreads) {
  const double one = VectorPeakGflops(1);
  ASSERT_GT(one, 0) << "no 'cpu MHz' in /proc/cpuinfo";
  EXPECT_DOUBLE_EQ(VectorPeakGflops(3), 3 * one);
}

// The default set-up: on a CPU with vector units BLIS does not run its
// 'generic' kernels, every probed kernel set that ran is reported with a
// rate, and products stay correct.
TEST(ComputeSetupTest, ProbedKernelsAreNotGenericAndProductsStayCorrect) {
  unsetenv("BLIS_ARCH_TYPE");
  ComputeOptions options;
  options.threads = 2;
  auto setup = ConfigureCompute(options);
  ASSERT_TRUE(setup.ok()) << setup.status();
  std::cout << setup->Summary() << std::endl;
  EXPECT_EQ(setup->threads, 2);
  EXPECT_EQ(setup->gemm_threads, 2);
  EXPECT_GT(setup->gemm_gflops, 0);
  EXPECT_THAT(setup->Summary(), HasSubstr("GFLOP/s on 2 threads"));
  ExpectMatmulMatchesHandSums();
  if (!IsBlis(*setup)) GTEST_SKIP() << "the system BLAS is " << setup->blas << ", not BLIS";
  ASSERT_THAT(setup->kernels_source, ::testing::AnyOf("library", "probed"));
  if (CandidateBlisKernels().size() > 1) {
    EXPECT_NE(setup->kernels, "generic") << setup->Summary();
    EXPECT_THAT(setup->Summary(), HasSubstr("kernels '" + setup->kernels + "'"));
  }
  for (const KernelProbe& p : setup->probes) {
    EXPECT_TRUE(p.error.empty() ? p.gflops > 0 : p.gflops == 0) << p.name << ": " << p.error;
  }
  if (setup->kernels_source == "probed") {
    // The choice is exported for child processes.
    ASSERT_NE(getenv("BLIS_ARCH_TYPE"), nullptr);
  }
  // 1 against 2 BLAS threads is timed for the pthreads build only; the
  // OpenMP build keeps the threads.
  const bool pthreads = setup->blas.find("pthread") != std::string::npos;
  EXPECT_THAT(setup->blas_thread_gflops, ::testing::SizeIs(pthreads ? 2 : 0));
  if (!pthreads) {
    EXPECT_EQ(setup->blas_threads, 2);
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The probe's choice is cached for this CPU and BLIS: the next set-up (the
// next start of a service) takes it without probing. An entry of another CPU
// or BLIS, or naming kernels this BLIS lacks, is not trusted.
TEST(ComputeSetupTest, TheKernelChoiceIsCachedForThisCpuAndBlis) {
  unsetenv("BLIS_ARCH_TYPE");
  const test_util::TempDir temp("himoe_kernel_cache");
  const std::string& dir = temp.path();
  ComputeOptions options;
  options.threads = 1;
  options.gemm_gflops = -1;
  options.kernel_cache_file = dir + "/sub/blis-kernels";
  auto first = ConfigureCompute(options);
  ASSERT_TRUE(first.ok()) << first.status();
  if (!IsBlis(*first)) GTEST_SKIP() << "the system BLAS is " << first->blas << ", not BLIS";
  if (first->kernels_source == "library") {
    GTEST_SKIP() << "BLIS knows this CPU (kernels '" << first->kernels
                 << "'): nothing is probed, so nothing is cached";
  }
  ASSERT_EQ(first->kernels_source, "probed");
  const std::vector<std::string> lines =
      absl::StrSplit(ReadFile(options.kernel_cache_file), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u);
  const std::string key = lines[0];
  EXPECT_THAT(key, HasSubstr("model name="));
  EXPECT_THAT(key, HasSubstr("| blis OK generic "));
  EXPECT_EQ(lines[1], first->kernels);
  const std::string exported = getenv("BLIS_ARCH_TYPE");

  unsetenv("BLIS_ARCH_TYPE");
  auto cached = ConfigureCompute(options);
  ASSERT_TRUE(cached.ok()) << cached.status();
  EXPECT_EQ(cached->kernels_source, "cached");
  EXPECT_EQ(cached->kernels, first->kernels);
  EXPECT_TRUE(cached->probes.empty());
  ASSERT_NE(getenv("BLIS_ARCH_TYPE"), nullptr);
  EXPECT_EQ(getenv("BLIS_ARCH_TYPE"), exported);
  EXPECT_THAT(cached->Summary(), HasSubstr("kernels '" + first->kernels + "' (cached)"));

  for (const std::string& stale : {absl::StrCat("cpu another one\n", first->kernels, "\n"),
                                   absl::StrCat(key, "\nno-such-kernels\n")}) {
    SCOPED_TRACE(stale);
    std::ofstream(options.kernel_cache_file, std::ios::trunc) << stale;
    unsetenv("BLIS_ARCH_TYPE");
    auto again = ConfigureCompute(options);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->kernels_source, "probed");
    EXPECT_FALSE(again->probes.empty());
    EXPECT_EQ(ReadFile(options.kernel_cache_file), absl::StrCat(key, "\n", again->kernels, "\n"));
  }
  ExpectMatmulMatchesHandSums();
}

// BLIS_ARCH_TYPE from the environment wins, is named, and 'generic' warns.
TEST(ComputeSetupTest, ForcedGenericKernelsAreNamedAndWarnedAbout) {
  ComputeOptions options;
  options.threads = 1;
  options.gemm_gflops = -1;
  // BLIS 0.9 reads a number: 'generic' is the last of its kernel sets.
  setenv("BLIS_ARCH_TYPE", "25", 1);
  auto setup = ConfigureCompute(options);
  ASSERT_TRUE(setup.ok()) << setup.status();
  if (!IsBlis(*setup)) GTEST_SKIP() << "the system BLAS is " << setup->blas << ", not BLIS";
  EXPECT_EQ(setup->kernels_source, "BLIS_ARCH_TYPE");
  EXPECT_EQ(setup->kernels, "generic");
  EXPECT_TRUE(setup->probes.empty());
  EXPECT_EQ(setup->gemm_gflops, 0);  // -1: not measured
  EXPECT_THAT(setup->Warnings(), Contains(HasSubstr("'generic' kernels")));
  ExpectMatmulMatchesHandSums();
}

// A coordinator with 1 thread that leaves a core to its expert processes
// measures the rate of both cores, in a child process.
TEST(ComputeSetupTest, TheGemmRateMayUseMoreThreadsThanTheProcess) {
  ComputeOptions options;
  options.threads = 1;
  options.gemm_threads = 2;
  auto setup = ConfigureCompute(options);
  ASSERT_TRUE(setup.ok()) << setup.status();
  EXPECT_EQ(setup->threads, 1);
  EXPECT_EQ(setup->gemm_threads, 2);
  EXPECT_GT(setup->gemm_gflops, 0);
  EXPECT_EQ(at::get_num_threads(), 1);
  ExpectMatmulMatchesHandSums();
}

TEST(ComputeSetupTest, AGivenGemmRateIsKept) {
  ComputeOptions options;
  options.threads = 1;
  options.probe_kernels = false;
  options.gemm_gflops = 123.5;
  auto setup = ConfigureCompute(options);
  ASSERT_TRUE(setup.ok()) << setup.status();
  EXPECT_EQ(setup->gemm_gflops, 123.5);
  EXPECT_TRUE(setup->probes.empty());
  EXPECT_THAT(setup->Summary(), HasSubstr("GEMM rate 123.5 GFLOP/s"));
  EXPECT_THAT(setup->Warnings(), Not(Contains(HasSubstr("BLAS runs on 1 thread"))));
}

// One compute thread, no kernel probe and no GEMM-rate probe.
ComputeOptions OneThreadWithoutProbes() {
  ComputeOptions options;
  options.threads = 1;
  options.probe_kernels = false;
  options.gemm_gflops = -1;
  return options;
}

// Freed memory stays in the heap: a block far over glibc's default mmap
// threshold (128 KiB) comes from the heap, not from a mapping of its own.
TEST(ComputeSetupTest, TheHeapIsKeptForReuse) {
  ASSERT_EQ(std::getenv("MALLOC_MMAP_THRESHOLD_"), nullptr);
  auto setup = ConfigureCompute(OneThreadWithoutProbes());
  ASSERT_TRUE(setup.ok()) << setup.status();
  EXPECT_EQ(setup->malloc, "heap kept (mmap from 32 MiB, trim above 256 MiB)");
  EXPECT_THAT(setup->Summary(), HasSubstr("malloc: heap kept"));
  const size_t mapped_before = mallinfo2().hblks;
  void* block = std::malloc(8 << 20);
  ASSERT_NE(block, nullptr);
  static_cast<volatile char*>(block)[0] = 1;
  EXPECT_EQ(mallinfo2().hblks, mapped_before);
  std::free(block);
}

// Small products take the small-rows path exactly when it measured under 2/3 of the
// 4-row GEMM, and himoe::Linear follows the choice.
TEST(ComputeSetupTest, SmallProductsGoRowwiseOnlyWhereMeasuredFaster) {
  auto setup = ConfigureCompute(OneThreadWithoutProbes());
  ASSERT_TRUE(setup.ok()) << setup.status();
  EXPECT_GT(setup->small_gemm_us, 0);
  EXPECT_GT(setup->small_rows_us, 0);
  const bool faster = setup->small_rows_us < setup->small_gemm_us * 2 / 3;
  EXPECT_EQ(setup->rowwise_linear_rows, faster ? kRowwiseLinearRowsWhenFaster : 0);
  EXPECT_EQ(RowwiseLinearRows(), setup->rowwise_linear_rows);
  EXPECT_THAT(setup->Summary(), HasSubstr(faster ? "small-rows under 16 rows" : "(GEMM)"));
}

}  // namespace
}  // namespace himoe
