#include "common/compute_setup.h"

#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>

#include <glog/logging.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/gemm_rate.h"
#include "common/malloc_tuning.h"
#include "common/matmul.h"
#include "common/parallel_for.h"
#include "common/small_product_choice.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"

namespace himoe {
namespace {

// The BLAS's name for the log. With no BLAS library loaded it is inside
// LibTorch, named from LibTorch's build.
std::string BlasName(const BlasLibrary& library) {
  if (library.blis() || !library.path.empty()) return library.Name();
  return BlasDisplayName(library.path, at::hasMKL(), at::show_config());
}

}  // namespace

absl::StatusOr<ComputeSetup> ConfigureCompute(const ComputeOptions& options) {
  ComputeSetup setup;
  setup.malloc = options.keep_heap ? KeepHeap() : "glibc defaults";
  const BlasLibrary library = BlasLibrary::Find();
  setup.blas = BlasName(library);
  HIMOE_RETURN_IF_ERROR(ConfigureTorchThreads(options.threads));
  setup.threads = at::get_num_threads();
  setup.blas_threads = setup.threads;
  SetParallelForEnabled(options.split_products);
  setup.split_products = options.split_products;
  if (library.blis()) {
    // Every choice is timed in a child, before this process's first product.
    if (const char* forced = std::getenv(kBlisArchEnv); forced && *forced) {
      setup.kernels = BlisKernelName(forced);
      setup.kernels_source = kBlisArchEnv;
    } else {
      BlisKernelChoice choice = SelectBlisKernels(options.probe_kernels, options.kernel_cache_file);
      setup.kernels = std::move(choice.kernels);
      setup.kernels_source = std::move(choice.source);
      setup.probes = std::move(choice.probes);
    }
    if (options.probe_kernels && library.blis_threading == "pthread") {
      BlisThreadChoice choice = SelectBlisThreads(setup.threads);
      setup.blas_threads = choice.blas_threads;
      setup.blas_thread_gflops = std::move(choice.gflops);
    }
  }
  setup.gemm_threads = options.gemm_threads > 0 ? options.gemm_threads : setup.threads;
  if (options.gemm_gflops > 0) {
    setup.gemm_gflops = options.gemm_gflops;
  } else if (options.gemm_gflops == 0 && setup.gemm_threads == setup.threads) {
    HIMOE_ASSIGN_OR_RETURN(setup.gemm_gflops, MeasureGemmRate(options.bf16_products));
  } else if (options.gemm_gflops == 0) {
    HIMOE_ASSIGN_OR_RETURN(setup.gemm_gflops,
                           MeasureGemmRateInFreshProcess(setup.gemm_threads,
                                                         setup.blas_threads < setup.threads
                                                             ? 1
                                                             : setup.gemm_threads,
                                                         options.bf16_products));
  }
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    const SmallProductChoice small = ChooseSmallProducts();
    setup.small_gemm_us = small.gemm_us;
    setup.small_rows_us = small.small_rows_us;
    setup.rowwise_linear_rows = small.rowwise_linear_rows;
    return absl::OkStatus();
  }));
  setup.gemm_bf16 = options.bf16_products;
  if (!setup.gemm_bf16) setup.vector_peak_gflops = VectorPeakGflops(setup.gemm_threads);
  return setup;
}

void LogComputeSetup(const ComputeSetup& setup) {
  LOG(INFO) << setup.Summary();
  for (const std::string& warning : setup.Warnings()) LOG(WARNING) << warning;
}

absl::Status ConfigureServingCompute(int threads, bool probe_kernels) {
  ComputeOptions options;
  options.threads = threads;
  options.probe_kernels = probe_kernels;
  options.kernel_cache_file = DefaultKernelCacheFile();
  options.gemm_gflops = -1;
  HIMOE_ASSIGN_OR_RETURN(const ComputeSetup setup, ConfigureCompute(options));
  LogComputeSetup(setup);
  return absl::OkStatus();
}

std::string ComputeSetup::Summary() const {
  std::string line = absl::StrFormat(
      "compute: %d threads (BLAS %d), %s, kernels '%s' (%s)", threads,
      blas_threads, blas, kernels.empty() ? "n/a" : kernels,
      kernels_source.empty() ? "n/a" : kernels_source);
  if (!malloc.empty()) absl::StrAppend(&line, "; malloc: ", malloc);
  if (threads > 1) {
    absl::StrAppend(&line, split_products ? "; experts side by side, a thread each"
                                          : "; experts one at a time, on every thread");
  }
  if (!probes.empty()) {
    std::vector<std::string> parts;
    for (const KernelProbe& p : probes) {
      parts.push_back(p.error.empty()
                          ? absl::StrFormat("%s %.1f", p.name, p.gflops)
                          : absl::StrCat(p.name, " failed: ", p.error));
    }
    absl::StrAppend(&line, "; probed GFLOP/s per thread: ",
                    absl::StrJoin(parts, ", "));
  }
  if (blas_thread_gflops.size() == 2) {
    absl::StrAppendFormat(&line, "; BLAS on 1 / %d threads: %.1f / %.1f GFLOP/s", threads,
                          blas_thread_gflops[0], blas_thread_gflops[1]);
  }
  if (small_gemm_us > 0) {
    absl::StrAppendFormat(&line, "; a 4-row product: GEMM %.0f us, small-rows %.0f us (%s)",
                          small_gemm_us, small_rows_us,
                          rowwise_linear_rows > 0
                              ? absl::StrCat("small-rows under ", rowwise_linear_rows, " rows")
                              : std::string("GEMM"));
  }
  if (gemm_gflops > 0) {
    absl::StrAppendFormat(&line, "; GEMM rate %.1f GFLOP/s on %d threads%s", gemm_gflops,
                          gemm_threads,
                          gemm_bf16 ? absl::StrCat(" (bf16 operands, ",
                                                   Bf16GemmNative() ? "oneDNN" : "rounded, BLAS",
                                                   ")")
                                    : std::string());
    if (vector_peak_gflops > 0) {
      absl::StrAppendFormat(&line,
                            " (%.0f%% of %.0f, the vector units' peak at the clock "
                            "/proc/cpuinfo reports; turbo clocks exceed it)",
                            100 * gemm_gflops / vector_peak_gflops, vector_peak_gflops);
    }
  }
  return line;
}

std::vector<std::string> ComputeSetup::Warnings() const {
  std::vector<std::string> warnings;
  if (kernels == "generic") {
    warnings.push_back(
        "BLIS runs its 'generic' kernels, several times slower than this "
        "CPU's vector units allow; set BLIS_ARCH_TYPE to a kernel set the CPU "
        "supports (BLIS_ARCH_DEBUG=1 shows the choice)");
  }
  if (blas_threads < threads) {
    warnings.push_back(absl::StrCat(
        "BLAS runs on 1 thread: with ", threads,
        " it was slower on a training-sized product (BLIS's pthreads build "
        "starts threads on every call; libblis4-openmp does not)"));
  }
  if (gemm_gflops > 0 && vector_peak_gflops > 0 &&
      gemm_gflops < 0.25 * vector_peak_gflops) {
    warnings.push_back(absl::StrFormat(
        "GEMM rate %.1f GFLOP/s is under 25%% of the %.0f GFLOP/s this CPU's "
        "vector units promise",
        gemm_gflops, vector_peak_gflops));
  }
  return warnings;
}

}  // namespace himoe
