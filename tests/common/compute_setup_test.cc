// The set-up composed from its units (each tested in its own file). Each test
// runs in its own process (ctest), so BLIS starts fresh in each: it reads
// BLIS_ARCH_TYPE and BLIS_NUM_THREADS once, on its first product.

#include "common/compute_setup.h"

#include <stdlib.h>

#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/linear.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/hand_matmul.h"

namespace himoe {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using test_util::ExpectMatmulMatchesHandSums;

bool IsBlis(const ComputeSetup& setup) { return setup.blas.rfind("BLIS", 0) == 0; }

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

// The heap's set-up (KeepHeap, tested in malloc_tuning_test) is logged.
TEST(ComputeSetupTest, TheHeapSetUpIsLogged) {
  auto setup = ConfigureCompute(OneThreadWithoutProbes());
  ASSERT_TRUE(setup.ok()) << setup.status();
  EXPECT_FALSE(setup->malloc.empty());
  EXPECT_THAT(setup->Summary(), HasSubstr("; malloc: " + setup->malloc));
  ComputeOptions glibc = OneThreadWithoutProbes();
  glibc.keep_heap = false;
  auto kept = ConfigureCompute(glibc);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->malloc, "glibc defaults");
}

// The few-row product path chosen (small_product_choice) is the set-up's, and
// logged.
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

// The log line and the warnings, from a set-up given by hand.
TEST(ComputeSetupTest, TheSummaryNamesEachChoice) {
  ComputeSetup setup;
  setup.threads = 2;
  setup.blas_threads = 1;
  setup.blas = "BLIS (pthread)";
  setup.kernels = "skx";
  setup.kernels_source = "cached";
  setup.malloc = "heap kept (mmap from 32 MiB, trim above 256 MiB)";
  setup.blas_thread_gflops = {40, 30};
  setup.small_gemm_us = 150;
  setup.small_rows_us = 29;
  setup.rowwise_linear_rows = kRowwiseLinearRowsWhenFaster;
  setup.gemm_gflops = 100;
  setup.gemm_threads = 2;
  setup.vector_peak_gflops = 500;
  EXPECT_EQ(setup.Summary(),
            "compute: 2 threads (BLAS 1), BLIS (pthread), kernels 'skx' (cached); malloc: heap "
            "kept (mmap from 32 MiB, trim above 256 MiB); experts side by side, a thread each; "
            "BLAS on 1 / 2 threads: 40.0 / 30.0 GFLOP/s; a 4-row product: GEMM 150 us, "
            "small-rows 29 us (small-rows under 16 rows); GEMM rate 100.0 GFLOP/s on 2 threads "
            "(20% of 500, the vector units' peak at the clock /proc/cpuinfo reports; turbo "
            "clocks exceed it)");
  EXPECT_THAT(setup.Warnings(), ElementsAre(HasSubstr("BLAS runs on 1 thread: with 2"),
                                            HasSubstr("GEMM rate 100.0 GFLOP/s is under 25%")));

  ComputeSetup probed;
  probed.blas = "BLIS (openmp)";
  probed.kernels = "generic";
  probed.kernels_source = "library";
  probed.probes = {KernelProbe{"skx", 0, "killed by signal 4"}, KernelProbe{"generic", 43.21, ""}};
  EXPECT_THAT(probed.Summary(),
              HasSubstr("kernels 'generic' (library); probed GFLOP/s per thread: skx failed: "
                        "killed by signal 4, generic 43.2"));
  EXPECT_THAT(probed.Summary(), Not(HasSubstr("GEMM rate")));
  EXPECT_THAT(probed.Warnings(), ElementsAre(HasSubstr("'generic' kernels")));
}

}  // namespace
}  // namespace himoe
