#ifndef HIMOE_COMMON_COMPUTE_SETUP_H_
#define HIMOE_COMMON_COMPUTE_SETUP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/blas_kernel_probe.h"
#include "common/blas_library.h"
#include "common/blis_kernel_cache.h"
#include "common/cpu_vector_units.h"

namespace himoe {

// The compute set-up composes one unit per job: the loaded BLAS
// (blas_library), the CPU's vector units (cpu_vector_units), BLIS's kernels
// and threads timed in probe processes (blas_kernel_probe, probe_process),
// the kernel cache (blis_kernel_cache), the heap (malloc_tuning), the GEMM
// rate (gemm_rate) and the path of few-row products (small_product_choice).
// The units' headers come with this one, for what the binaries call
// (DefaultKernelCacheFile, ...).

// How a process sets up its CPU math: threads, the BLAS kernels, and the GEMM
// rate that utilisation (MFU) is measured against.
struct ComputeOptions {
  // Torch intra-op and BLAS threads; <= 0 means all cores.
  int threads = 0;
  // With BLIS and no BLIS_ARCH_TYPE in the environment: time each kernel set
  // (sub-configuration) the CPU supports in a child process, check its result,
  // and keep the fastest. Otherwise BLIS picks, and on CPUs it does not know
  // it falls back to its slow 'generic' kernels.
  bool probe_kernels = true;
  // Where the probe's choice is kept for the next start on this CPU and BLIS
  // (DefaultKernelCacheFile()); empty = probe every time.
  std::string kernel_cache_file;
  // The machine's GEMM rate in GFLOP/s; > 0 skips the probe that measures it,
  // 0 measures it, < 0 neither (gemm_gflops stays 0).
  double gemm_gflops = 0;
  // Threads of the GEMM-rate probe; 0 = `threads`. A coordinator that leaves
  // cores to its expert processes measures against all of them.
  int gemm_threads = 0;
  // Have glibc keep freed memory for reuse rather than unmapping and
  // trimming it (KeepHeap, common/malloc_tuning.h).
  bool keep_heap = true;
  // Independent products (a group's experts) side by side, each on one
  // thread, rather than one after another, each split across the threads
  // (SetParallelForEnabled).
  bool split_products = true;
  // The run's products take bfloat16 operands (MatmulBf16Out): the GEMM rate
  // is measured on those, and the fp32 vector peak is not compared.
  bool bf16_products = false;
};

struct ComputeSetup {
  int threads = 1;
  int blas_threads = 1;
  std::string malloc;          // how glibc's allocator was set up
  std::string blas;            // e.g. "BLIS (openmp)"
  std::string kernels;         // the kernel set in use, e.g. "skx"
  std::string kernels_source;  // "probed", "cached", "BLIS_ARCH_TYPE", "library"
  std::vector<KernelProbe> probes;
  // A [2048,128]x[128,512] product with 1 and with `threads` BLAS threads;
  // timed for BLIS's pthreads build only.
  std::vector<double> blas_thread_gflops;
  double gemm_gflops = 0;         // large GEMMs on `gemm_threads` threads
  bool gemm_bf16 = false;         // ... of bf16 operands (ComputeOptions::bf16_products)
  // A [4,256]x[256,1024] product as one GEMM and as SmallRowsLinear (microseconds,
  // best of several), and the RowwiseLinearRows() chosen from them.
  double small_gemm_us = 0, small_rows_us = 0;
  int64_t rowwise_linear_rows = 0;
  bool split_products = true;
  int gemm_threads = 1;
  // The vector units' peak at the clock /proc/cpuinfo reports; 0 if unknown.
  double vector_peak_gflops = 0;

  // One line for the log.
  std::string Summary() const;
  // Why this set-up is likely far from the machine's limit; empty if not.
  std::vector<std::string> Warnings() const;
};

// Configures threads and BLAS kernels, then measures the GEMM rate. Call it
// first in main, before any matmul and before other threads start: the kernel
// probe forks, and BLIS reads BLIS_ARCH_TYPE once, on its first call. The
// choice is exported in BLIS_ARCH_TYPE, so child processes (expert groups
// started by the trainer) inherit it without probing again.
absl::StatusOr<ComputeSetup> ConfigureCompute(const ComputeOptions& options);

// Summary() at INFO, each warning at WARNING.
void LogComputeSetup(const ComputeSetup& setup);

// The serving binaries' set-up: ConfigureCompute with the default kernel
// cache and without the GEMM-rate probe, logged.
absl::Status ConfigureServingCompute(int threads, bool probe_kernels);

}  // namespace himoe

#endif  // HIMOE_COMMON_COMPUTE_SETUP_H_
