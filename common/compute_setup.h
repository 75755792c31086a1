#ifndef HIMOE_COMMON_COMPUTE_SETUP_H_
#define HIMOE_COMMON_COMPUTE_SETUP_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace himoe {

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
  // trimming it (see KeepHeap in compute_setup.cc).
  bool keep_heap = true;
  // Independent products (a group's experts) side by side, each on one
  // thread, rather than one after another, each split across the threads
  // (SetParallelForEnabled).
  bool split_products = true;
  // The run's products take bfloat16 operands (MatmulBf16Out): the GEMM rate
  // is measured on those, and the fp32 vector peak is not compared.
  bool bf16_products = false;
};

// One kernel set timed by the probe.
struct KernelProbe {
  std::string name;
  double gflops = 0;  // one thread, on a [1024,256]x[256,512] product
  std::string error;  // empty when the kernels ran and matched the reference
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

// The kernel cache of this user: $HIMOE_CACHE_DIR/blis-kernels (an empty
// HIMOE_CACHE_DIR: none), else $XDG_CACHE_HOME/himoe/..., else
// $HOME/.cache/himoe/...
std::string DefaultKernelCacheFile();

// The serving binaries' set-up: ConfigureCompute with the default kernel
// cache and without the GEMM-rate probe, logged.
absl::Status ConfigureServingCompute(int threads, bool probe_kernels);

// The BLAS that runs LibTorch's CPU GEMMs, for the log. `loaded_path`: the
// libblas.so / libopenblas loaded in the process (resolved), empty if none;
// then the BLAS is inside LibTorch (pip's wheels link MKL statically), named
// from `has_mkl` (at::hasMKL()) or else `torch_config`'s BLAS_INFO
// (at::show_config()).
std::string BlasDisplayName(const std::string& loaded_path, bool has_mkl,
                            const std::string& torch_config);

// Kernel sets this CPU can run, fastest family first (BLIS names).
std::vector<std::string> CandidateBlisKernels();

// threads x GHz x fp32 lanes x 2 (FMA) x 2 (FMA units), from CPU flags and
// /proc/cpuinfo; 0 when the clock is unknown.
double VectorPeakGflops(int threads);

}  // namespace himoe

#endif  // HIMOE_COMMON_COMPUTE_SETUP_H_
