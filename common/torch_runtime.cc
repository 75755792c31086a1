#include "common/torch_runtime.h"

#include <dlfcn.h>

#include <cstdlib>
#include <exception>
#include <string>

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace himoe {

absl::Status ConfigureTorchThreads(int threads) {
  // An explicit count wins over an inherited BLIS_NUM_THREADS: a process
  // started with --threads 1 by one that set it to the core count (the
  // trainer's expert processes) must not run one BLIS thread per core.
  const bool explicit_count = threads > 0;
  if (!explicit_count) threads = DefaultThreadCount();
  // LibTorch hands whole matmuls to the system BLAS, whose own thread pool
  // at::set_num_threads does not reach. BLIS (1 thread by default) reads
  // BLIS_NUM_THREADS when it initializes on its first call, so this must run
  // before any matmul.
  setenv("BLIS_NUM_THREADS", std::to_string(threads).c_str(), explicit_count ? 1 : 0);
  using SetOpenBlas = void (*)(int);
  if (auto set = reinterpret_cast<SetOpenBlas>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    set(threads);
  }
  return CatchTorchErrors([&] {
    at::set_num_threads(threads);
    return absl::OkStatus();
  });
}

absl::StatusOr<c10::Device> ParseDevice(absl::string_view spec) {
  if (spec == "cpu") return c10::Device(c10::kCPU);
  if (spec.rfind("cuda", 0) == 0) {
    if (!at::hasCUDA()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "device '", spec, "' requested, but this LibTorch build has no CUDA"));
    }
  }
  try {
    return c10::Device(std::string(spec));
  } catch (const c10::Error&) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device: expected 'cpu' or 'cuda:K', got '", spec, "'"));
  }
}

absl::Status CatchTorchErrors(const std::function<absl::Status()>& fn) {
  try {
    return fn();
  } catch (const StatusException& e) {
    return e.status();
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("torch error: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("error: ", e.what()));
  }
}

}  // namespace himoe
