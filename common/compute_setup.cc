#include "common/compute_setup.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <link.h>
#include <malloc.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>

#include <glog/logging.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"
#include "common/linear.h"
#include "common/matmul.h"
#include "common/parallel_for.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"

namespace himoe {
namespace {

constexpr char kArchEnv[] = "BLIS_ARCH_TYPE";

// Probe inputs come from their own generator: the global one seeds the model.
at::Tensor ProbeMatrix(int64_t rows, int64_t cols) {
  static at::Generator generator = at::detail::createCPUGenerator(20261123);
  return at::randn({rows, cols}, generator);
}

// The loaded libblas.so.3, resolved through the alternatives symlinks.
std::string LoadedBlasPath() {
  std::string found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        const std::string name = info->dlpi_name ? info->dlpi_name : "";
        if (name.find("libblas.so") == std::string::npos &&
            name.find("libopenblas") == std::string::npos) {
          return 0;
        }
        char resolved[PATH_MAX];
        *static_cast<std::string*>(data) =
            realpath(name.c_str(), resolved) ? resolved : name;
        return 1;
      },
      &found);
  return found;
}

// Debian's BLIS builds live in blis-{openmp,pthread,serial}/; their
// libblas.so.3 exports the BLAS symbols only, so BLIS is steered through its
// environment (BLIS_ARCH_TYPE, BLIS_NUM_THREADS), read once at its first call.
struct BlasLibrary {
  std::string path;
  std::string blis_threading;  // "openmp", "pthread" or "serial"; empty: not BLIS

  static BlasLibrary Find() {
    BlasLibrary lib;
    lib.path = LoadedBlasPath();
    for (const char* threading : {"openmp", "pthread", "serial"}) {
      if (lib.path.find(absl::StrCat("/blis-", threading, "/")) != std::string::npos) {
        lib.blis_threading = threading;
      }
    }
    return lib;
  }
  bool blis() const { return !blis_threading.empty(); }
  std::string Name() const {
    if (blis()) return absl::StrCat("BLIS (", blis_threading, ")");
    if (!path.empty()) return BlasDisplayName(path, false, "");
    return BlasDisplayName(path, at::hasMKL(), at::show_config());
  }
};

// Asks libblis.so.4 (the same code as the libblas.so.3 BLIS builds) for its
// own kernel choice on this CPU and the ids of its kernel sets, which
// BLIS_ARCH_TYPE takes (BLIS 0.9 reads a number; a name reads as 0):
// "OK <choice> <name>=<id> ...". Call it in a child: the query fixes the
// choice of the library it loads.
std::string BlisKernelSets() {
  void* handle = dlopen("libblis.so.4", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return "ERR libblis.so.4 not found";
  auto id = reinterpret_cast<int (*)()>(dlsym(handle, "bli_arch_query_id"));
  auto name = reinterpret_cast<const char* (*)(int)>(dlsym(handle, "bli_arch_string"));
  if (!id || !name) return "ERR libblis.so.4 lacks bli_arch_query_id";
  std::string answer = absl::StrCat("OK ", name(id()));
  for (int i = 0; i < 64; ++i) {
    const char* set = name(i);
    if (set == nullptr) break;
    absl::StrAppend(&answer, " ", set, "=", i);
    if (std::string(set) == "generic") break;  // the last of arch_t
  }
  return answer;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

// Tensors of a step come and go every step. With glibc's defaults each one
// over its dynamic mmap threshold is mapped and unmapped, and the heap top is
// trimmed and regrown, so every step page-faults its memory in again (Route
// of 4096 tokens: 35 ms, 5 ms with the heap kept, on this project's VMs).
// Keeps freed memory for reuse instead, as jemalloc and tcmalloc do; MALLOC_*
// variables in the environment win.
std::string KeepHeap() {
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"}) {
    if (std::getenv(name) != nullptr) return absl::StrCat(name, " from the environment");
  }
  constexpr int kMmapThreshold = 32 << 20;  // glibc's largest
  constexpr int kTrimThreshold = 256 << 20;
  constexpr int kTopPad = 16 << 20;
  if (mallopt(M_MMAP_THRESHOLD, kMmapThreshold) != 1 ||
      mallopt(M_TRIM_THRESHOLD, kTrimThreshold) != 1 || mallopt(M_TOP_PAD, kTopPad) != 1) {
    return "glibc defaults (mallopt refused)";
  }
  return "heap kept (mmap from 32 MiB, trim above 256 MiB)";
}

// Times a [4,256]x[256,1024] product (an expert's first matrix on a decoding
// step's rows) as one GEMM and as SmallRowsLinear, and has himoe::Linear take
// the small-rows path where it takes under 2/3 of the GEMM: kernel sets
// without BLIS's small-matrix path pack the whole weight for every GEMM.
void ChooseSmallProducts(ComputeSetup& setup) {
  const at::Tensor w = ProbeMatrix(1024, 256);
  const at::Tensor x = ProbeMatrix(4, 256);
  const auto best_us = [](const std::function<void()>& product) {
    product();  // warm-up
    double best = std::numeric_limits<double>::infinity();
    for (int rep = 0; rep < 15; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      product();
      best = std::min(best, Seconds(start));
    }
    return 1e6 * best;
  };
  setup.small_gemm_us = best_us([&] { at::linear(x, w); });
  setup.small_rows_us = best_us([&] { SmallRowsLinear(x, w, at::Tensor()); });
  setup.rowwise_linear_rows =
      setup.small_rows_us < setup.small_gemm_us * 2 / 3 ? kRowwiseLinearRowsWhenFaster : 0;
  SetRowwiseLinearRows(setup.rowwise_linear_rows);
}

// Best rate of a @ b over repeated products for about `seconds`; with
// `bf16`, MatmulBf16Out's products.
double TimeGemm(const at::Tensor& a, const at::Tensor& b, double seconds, bool bf16 = false) {
  const double flops = 2.0 * a.size(0) * a.size(1) * b.size(1);
  at::Tensor c = at::mm(a, b);  // warm-up: packing buffers, thread start
  const auto product = [&] {
    if (bf16) {
      MatmulBf16Out(c, a, b, 0.0f);
    } else {
      at::mm_out(c, a, b);
    }
  };
  product();
  double best = 0;
  const auto start = std::chrono::steady_clock::now();
  int reps = 0;
  while (reps < 3 || Seconds(start) < seconds) {
    const auto t0 = std::chrono::steady_clock::now();
    product();
    best = std::max(best, flops / Seconds(t0) / 1e9);
    ++reps;
  }
  return best;
}

// Largest |c - a@b| over `rows` x `cols` entries, against double sums.
double MaxGemmError(const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& c, int64_t rows, int64_t cols) {
  const auto ac = a.accessor<float, 2>();
  const auto bc = b.accessor<float, 2>();
  const auto cc = c.accessor<float, 2>();
  double worst = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      double sum = 0;
      for (int64_t k = 0; k < a.size(1); ++k) {
        sum += static_cast<double>(ac[i][k]) * bc[k][j];
      }
      worst = std::max(worst, std::abs(sum - cc[i][j]));
    }
  }
  return worst;
}

// Runs in a probe's child: times a product of `rows` x `inner` x `cols` on
// `threads` threads and checks the result; "OK <GFLOP/s>" or "ERR <why>".
std::string RunGemmProbe(int threads, int64_t rows, int64_t inner, int64_t cols,
                         double seconds, bool bf16 = false) {
  try {
    at::set_num_threads(threads);
    const at::Tensor a = ProbeMatrix(rows, inner);
    const at::Tensor b = ProbeMatrix(inner, cols);
    const double gflops = TimeGemm(a, b, seconds, bf16);
    // Each entry sums `inner` products of N(0,1) values (|c| ~ 16 for 256),
    // float error ~1e-5 relative, bf16 operands' ~4e-3; a wrong kernel is
    // off by O(|c|).
    at::Tensor c = at::mm(a, b);
    if (bf16) MatmulBf16Out(c, a, b, 0.0f);
    const double error = MaxGemmError(a, b, c, 16, cols);
    if (!(error < (bf16 ? 1.0 : 1e-2))) {
      return absl::StrFormat("ERR wrong result: max error %g", error);
    }
    return absl::StrFormat("OK %.3f", gflops);
  } catch (const std::exception& e) {
    return absl::StrCat("ERR ", e.what());
  }
}

// Forks; the child sets BLIS_ARCH_TYPE (unset for `kernels` empty) and
// BLIS_NUM_THREADS, runs `body` and writes its one-line answer to a pipe. A
// child that crashes (SIGILL on kernels the CPU lacks) or hangs yields "ERR".
std::string InChild(const std::string& kernels, int blas_threads,
                    const std::function<std::string()>& body) {
  int fds[2];
  if (pipe(fds) != 0) return "ERR pipe failed";
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return "ERR fork failed";
  }
  if (pid == 0) {
    close(fds[0]);
    if (kernels.empty()) {
      unsetenv(kArchEnv);
    } else {
      setenv(kArchEnv, kernels.c_str(), 1);
    }
    setenv("BLIS_NUM_THREADS", std::to_string(blas_threads).c_str(), 1);
    const std::string answer = body();
    ssize_t ignored = write(fds[1], answer.data(), answer.size());
    (void)ignored;
    _exit(0);
  }
  close(fds[1]);
  std::string answer;
  const auto start = std::chrono::steady_clock::now();
  char buffer[256];
  bool eof = false;
  while (!eof && Seconds(start) < 30) {
    pollfd pfd{fds[0], POLLIN, 0};
    if (poll(&pfd, 1, 1000) <= 0) continue;
    const ssize_t n = read(fds[0], buffer, sizeof(buffer));
    if (n > 0) {
      answer.append(buffer, n);
    } else {
      eof = true;  // the child wrote its answer, or died
    }
  }
  close(fds[0]);
  if (!eof) kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!eof) return "ERR timed out";
  if (WIFSIGNALED(status)) {
    return absl::StrCat("ERR killed by signal ", WTERMSIG(status));
  }
  return answer.empty() ? "ERR no answer" : answer;
}

// "OK <x>" -> x; otherwise the error text in `error`.
double ParseProbe(const std::string& answer, std::string* error) {
  double value = 0;
  if (absl::StartsWith(answer, "OK ") &&
      absl::SimpleAtod(answer.substr(3), &value)) {
    return value;
  }
  *error = std::string(absl::StripPrefix(answer, "ERR "));
  return 0;
}

bool CpuHas(const char* feature) {
  __builtin_cpu_init();
  if (std::string(feature) == "avx512") {
    return __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }
  if (std::string(feature) == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  return __builtin_cpu_supports("avx");
}

// What a cached kernel choice is valid for: this CPU (its /proc/cpuinfo
// identity and flags) and this BLIS (its table of kernel sets).
std::string KernelCacheKey(const std::string& blis_table) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, identity;
  uint64_t flags_hash = 14695981039346656037ull;  // FNV-1a of the flags line
  while (std::getline(cpuinfo, line) && !line.empty()) {  // the first processor
    const std::string field(absl::StripAsciiWhitespace(line.substr(0, line.find(':'))));
    const std::string value(
        absl::StripAsciiWhitespace(line.find(':') == std::string::npos
                                       ? ""
                                       : line.substr(line.find(':') + 1)));
    if (field == "vendor_id" || field == "cpu family" || field == "model" ||
        field == "model name" || field == "stepping") {
      absl::StrAppend(&identity, field, "=", value, ";");
    } else if (field == "flags") {
      for (const unsigned char c : value) flags_hash = (flags_hash ^ c) * 1099511628211ull;
    }
  }
  return absl::StrCat("cpu ", identity, " flags ", absl::Hex(flags_hash), " | blis ",
                      blis_table);
}

// The cached choice for `key`, or empty (no file, another key, or a kernel set
// BLIS does not list).
std::string ReadCachedKernels(const std::string& path, const std::string& key,
                              const std::map<std::string, std::string>& ids) {
  if (path.empty()) return "";
  std::ifstream in(path);
  std::string cached_key, kernels;
  if (!std::getline(in, cached_key) || !std::getline(in, kernels)) return "";
  if (cached_key != key || ids.count(kernels) == 0) return "";
  return kernels;
}

// Keeps BLIS's own kernel choice when it knows the CPU (anything but
// 'generic'); otherwise takes the choice cached for this CPU and BLIS, or
// times every kernel set the CPU supports, one thread each, keeps the fastest
// correct one and caches it. Exports the choice in BLIS_ARCH_TYPE.
void SelectBlisKernels(bool probe, const std::string& cache_file, ComputeSetup& setup) {
  const std::string table = InChild("", 1, [] { return BlisKernelSets(); });
  const std::vector<std::string> answer = absl::StrSplit(table, ' ', absl::SkipEmpty());
  if (answer.size() < 2 || answer[0] != "OK") {
    setup.kernels_source = "library";
    return;
  }
  std::map<std::string, std::string> ids;
  for (size_t i = 2; i < answer.size(); ++i) {
    const std::pair<std::string, std::string> kv = absl::StrSplit(answer[i], '=');
    ids[kv.first] = kv.second;
  }
  setup.kernels = answer[1];
  setup.kernels_source = "library";
  if (probe && setup.kernels == "generic") {
    const std::string key = KernelCacheKey(table);
    if (std::string cached = ReadCachedKernels(cache_file, key, ids); !cached.empty()) {
      setup.kernels = std::move(cached);
      setup.kernels_source = "cached";
    } else {
      double best = 0;
      for (const std::string& name : CandidateBlisKernels()) {
        if (ids.count(name) == 0) continue;
        KernelProbe p;
        p.name = name;
        p.gflops = ParseProbe(InChild(ids[name], 1,
                                      [] { return RunGemmProbe(1, 1024, 256, 512, 0.04); }),
                              &p.error);
        if (p.error.empty() && p.gflops > best) {
          best = p.gflops;
          setup.kernels = name;
          setup.kernels_source = "probed";
        }
        setup.probes.push_back(p);
      }
      if (setup.kernels_source == "probed" && !cache_file.empty()) {
        if (cache_file.rfind('/') != std::string::npos) {
          CreateDirectories(Dirname(cache_file)).IgnoreError();
        }
        // A cache that cannot be written only costs the next start a probe.
        if (absl::Status s = WriteFileAtomically(cache_file,
                                                 absl::StrCat(key, "\n", setup.kernels, "\n"));
            !s.ok()) {
          LOG(INFO) << "BLIS kernel choice not cached: " << s;
        }
      }
    }
  }
  if (ids.count(setup.kernels)) setenv(kArchEnv, ids[setup.kernels].c_str(), 1);
}

// The kernel set a BLIS_ARCH_TYPE value names, through the child's table.
std::string BlisKernelName(const std::string& value) {
  const std::vector<std::string> answer = absl::StrSplit(
      InChild("", 1, [] { return BlisKernelSets(); }), ' ', absl::SkipEmpty());
  for (size_t i = 2; i < answer.size(); ++i) {
    const std::pair<std::string, std::string> kv = absl::StrSplit(answer[i], '=');
    if (kv.second == value) return kv.first;
  }
  return value;
}

// BLIS's pthreads build starts threads on every call, which can cost more
// than it gains on the small products of a training step: keep `threads` BLAS
// threads only where they beat one thread on such a product. (The OpenMP
// build keeps them: 1.9x on 2 threads here. Its children could not be forked
// anyway: OpenMP hangs in a child forked after the parent used it.) The
// children run LibTorch on 1 thread, so no OpenMP either.
void SelectBlisThreads(ComputeSetup& setup) {
  setup.blas_threads = setup.threads;
  if (setup.threads <= 1) return;
  const auto rate = [&](int blas_threads) {
    std::string error;
    const char* kernels = std::getenv(kArchEnv);
    return ParseProbe(InChild(kernels ? kernels : "", blas_threads,
                              [&] { return RunGemmProbe(1, 2048, 128, 512, 0.05); }),
                      &error);
  };
  setup.blas_thread_gflops = {rate(1), rate(setup.threads)};
  if (setup.blas_thread_gflops[0] > setup.blas_thread_gflops[1]) {
    setup.blas_threads = 1;
    setenv("BLIS_NUM_THREADS", "1", 1);
  }
}

constexpr double kGemmRateSeconds = 0.3;
constexpr char kGemmProbeEnv[] = "HIMOE_GEMM_RATE_PROBE";

// The GEMM rate on other thread counts than this process's needs a process
// whose OpenMP and BLIS start fresh: this program, started again with
// HIMOE_GEMM_RATE_PROBE="<threads> <fd> <bf16 0|1>", answers on fd <fd> from
// a static initializer (RunGemmRateProbeIfAsked) and exits before main.
absl::StatusOr<double> GemmRateInFreshProcess(int threads, int blas_threads, bool bf16) {
  int fds[2];
  if (pipe(fds) != 0) return absl::InternalError("GEMM rate probe: pipe failed");
  fcntl(fds[0], F_SETFD, FD_CLOEXEC);
  const std::string request = absl::StrCat(threads, " ", fds[1], " ", bf16 ? 1 : 0);
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return absl::InternalError("GEMM rate probe: fork failed");
  }
  if (pid == 0) {
    setenv(kGemmProbeEnv, request.c_str(), 1);
    setenv("BLIS_NUM_THREADS", std::to_string(blas_threads).c_str(), 1);
    char self[] = "/proc/self/exe";
    char* argv[] = {self, nullptr};
    execv(self, argv);
    _exit(127);
  }
  close(fds[1]);
  std::string answer;
  char buffer[256];
  ssize_t n;
  while ((n = read(fds[0], buffer, sizeof(buffer))) > 0) answer.append(buffer, n);
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  std::string error;
  const double gflops = ParseProbe(answer.empty() ? "ERR no answer" : answer, &error);
  if (!error.empty()) return absl::InternalError(absl::StrCat("GEMM rate probe: ", error));
  return gflops;
}

bool RunGemmRateProbeIfAsked() {
  const char* request = std::getenv(kGemmProbeEnv);
  if (request == nullptr) return false;
  int threads = 0, fd = -1, bf16 = 0;
  const std::vector<std::string> parts = absl::StrSplit(request, ' ');
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &threads) ||
      !absl::SimpleAtoi(parts[1], &fd) || !absl::SimpleAtoi(parts[2], &bf16)) {
    _exit(2);
  }
  const std::string answer =
      RunGemmProbe(threads, 1024, 1024, 1024, kGemmRateSeconds, bf16 != 0);
  ssize_t ignored = write(fd, answer.data(), answer.size());
  (void)ignored;
  _exit(0);
}

[[maybe_unused]] const bool kGemmRateProbeChild = RunGemmRateProbeIfAsked();

}  // namespace

std::vector<std::string> CandidateBlisKernels() {
  std::vector<std::string> names;
  if (CpuHas("avx512")) names.push_back("skx");
  if (CpuHas("avx2")) {
    names.push_back("zen3");
    names.push_back("haswell");
  }
  if (CpuHas("avx")) names.push_back("sandybridge");
  names.push_back("generic");
  return names;
}

double VectorPeakGflops(int threads) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  double mhz = 0;
  while (std::getline(cpuinfo, line)) {
    if (!absl::StartsWith(line, "cpu MHz")) continue;
    const size_t colon = line.find(':');
    double value = 0;
    if (colon != std::string::npos &&
        absl::SimpleAtod(absl::StripAsciiWhitespace(line.substr(colon + 1)),
                         &value)) {
      mhz = std::max(mhz, value);
    }
  }
  if (mhz <= 0) return 0;
  const int lanes = CpuHas("avx512") ? 16 : CpuHas("avx") ? 8 : 4;
  return threads * mhz / 1000.0 * lanes * 2 * 2;
}

std::string BlasDisplayName(const std::string& loaded_path, bool has_mkl,
                            const std::string& torch_config) {
  if (absl::StrContains(loaded_path, "/blis-")) return "BLIS";
  if (absl::StrContains(loaded_path, "openblas")) return "OpenBLAS";
  if (absl::StrContains(loaded_path, "/blas/")) return "reference BLAS";
  if (!loaded_path.empty()) return loaded_path;
  if (has_mkl) return "MKL (inside LibTorch)";
  constexpr char kKey[] = "BLAS_INFO=";
  const size_t at = torch_config.find(kKey);
  if (at != std::string::npos) {
    const size_t begin = at + sizeof(kKey) - 1;
    const size_t end = torch_config.find_first_of(", \n", begin);
    const std::string info = torch_config.substr(begin, end - begin);
    if (!info.empty() && info != "generic") return absl::StrCat(info, " (inside LibTorch)");
  }
  return "no BLAS library (LibTorch's own GEMM)";
}

absl::StatusOr<ComputeSetup> ConfigureCompute(const ComputeOptions& options) {
  ComputeSetup setup;
  setup.malloc = options.keep_heap ? KeepHeap() : "glibc defaults";
  const BlasLibrary library = BlasLibrary::Find();
  setup.blas = library.Name();
  HIMOE_RETURN_IF_ERROR(ConfigureTorchThreads(options.threads));
  setup.threads = at::get_num_threads();
  setup.blas_threads = setup.threads;
  SetParallelForEnabled(options.split_products);
  setup.split_products = options.split_products;
  if (library.blis()) {
    // Every choice is timed in a child, before this process's first product.
    if (const char* forced = std::getenv(kArchEnv); forced && *forced) {
      setup.kernels = BlisKernelName(forced);
      setup.kernels_source = kArchEnv;
    } else {
      SelectBlisKernels(options.probe_kernels, options.kernel_cache_file, setup);
    }
    if (options.probe_kernels && library.blis_threading == "pthread") SelectBlisThreads(setup);
  }
  setup.gemm_threads = options.gemm_threads > 0 ? options.gemm_threads : setup.threads;
  if (options.gemm_gflops > 0) {
    setup.gemm_gflops = options.gemm_gflops;
  } else if (options.gemm_gflops == 0 && setup.gemm_threads == setup.threads) {
    HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
      setup.gemm_gflops = TimeGemm(ProbeMatrix(1024, 1024), ProbeMatrix(1024, 1024),
                                   kGemmRateSeconds, options.bf16_products);
      return absl::OkStatus();
    }));
  } else if (options.gemm_gflops == 0) {
    HIMOE_ASSIGN_OR_RETURN(setup.gemm_gflops,
                           GemmRateInFreshProcess(setup.gemm_threads,
                                                  setup.blas_threads < setup.threads
                                                      ? 1
                                                      : setup.gemm_threads,
                                                  options.bf16_products));
  }
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    ChooseSmallProducts(setup);
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

std::string DefaultKernelCacheFile() {
  std::string dir;
  if (const char* d = std::getenv("HIMOE_CACHE_DIR"); d != nullptr) {
    dir = d;  // empty: no cache
  } else if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg) {
    dir = absl::StrCat(xdg, "/himoe");
  } else if (const char* home = std::getenv("HOME"); home != nullptr && *home) {
    dir = absl::StrCat(home, "/.cache/himoe");
  }
  return dir.empty() ? "" : absl::StrCat(dir, "/blis-kernels");
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
