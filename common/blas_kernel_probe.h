#ifndef HIMOE_COMMON_BLAS_KERNEL_PROBE_H_
#define HIMOE_COMMON_BLAS_KERNEL_PROBE_H_

#include <string>
#include <vector>

namespace himoe {

// Which BLIS kernels and how many BLIS threads this process runs. Every choice
// is timed in a child process (RunInChild), before this process's first
// product: BLIS reads BLIS_ARCH_TYPE and BLIS_NUM_THREADS once, at its first
// call. Call these with BLIS loaded (BlasLibrary::Find().blis()).

// One kernel set timed by the probe.
struct KernelProbe {
  std::string name;
  double gflops = 0;  // one thread, on a [1024,256]x[256,512] product
  std::string error;  // empty when the kernels ran and matched the reference
};

struct BlisKernelChoice {
  std::string kernels;  // the kernel set in use, e.g. "skx"; empty: unknown
  std::string source;   // "probed", "cached" or "library"
  std::vector<KernelProbe> probes;
};

// The fastest probe that ran and matched the reference (the first of equals);
// empty if none did.
std::string FastestCorrectKernels(const std::vector<KernelProbe>& probes);

// Keeps BLIS's own kernel choice when it knows the CPU (anything but
// 'generic'); otherwise, with `probe`, takes the choice cached in
// `cache_file` for this CPU and BLIS, or times every kernel set the CPU
// supports (CandidateBlisKernels), one thread each, keeps the fastest correct
// one and caches it (an empty `cache_file`: no cache). Exports the choice in
// BLIS_ARCH_TYPE, so child processes (expert groups started by the trainer)
// inherit it without probing again.
BlisKernelChoice SelectBlisKernels(bool probe, const std::string& cache_file);

// The kernel set a BLIS_ARCH_TYPE value names, through BLIS's table; the
// value itself if the table does not list it.
std::string BlisKernelName(const std::string& value);

struct BlisThreadChoice {
  int blas_threads = 1;
  // A [2048,128]x[128,512] product on 1 and on `threads` BLIS threads; empty
  // when not timed (threads <= 1).
  std::vector<double> gflops;
};

// BLIS's pthreads build starts threads on every call, which can cost more
// than it gains on the small products of a training step: keeps `threads`
// BLAS threads only where they beat one thread on such a product, else sets
// BLIS_NUM_THREADS=1. (The OpenMP build keeps its threads, which pay there:
// see docs/benchmarks.md, Measurements behind choices in the code. Its
// children could not be forked anyway: OpenMP hangs in a child forked after
// the parent used it. The children here run LibTorch on 1 thread, so no
// OpenMP either.)
BlisThreadChoice SelectBlisThreads(int threads);

// The BLAS threads kept: `threads`, or 1 where one thread was faster.
int BlisThreadsFor(int threads, double one_thread_gflops, double threads_gflops);

}  // namespace himoe

#endif  // HIMOE_COMMON_BLAS_KERNEL_PROBE_H_
