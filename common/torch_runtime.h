#ifndef HIMOE_COMMON_TORCH_RUNTIME_H_
#define HIMOE_COMMON_TORCH_RUNTIME_H_

#include <exception>
#include <functional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/cpu_cores.h"
#include <c10/core/Device.h>

namespace himoe {

// Sets torch's intra-op thread count and the BLAS's (BLIS_NUM_THREADS;
// OpenBLAS through its API when loaded); `threads` <= 0 means "all cores", and
// then a BLIS_NUM_THREADS already in the environment is kept. Both default to 1 thread here, so every program calls this
// first, before any matmul.
absl::Status ConfigureTorchThreads(int threads);

// Parses "cpu" or "cuda:K"; CUDA devices are refused when LibTorch has no CUDA.
absl::StatusOr<c10::Device> ParseDevice(absl::string_view spec);

// Carries an absl::Status through code that can only throw, such as a custom
// autograd function: CatchTorchErrors returns the status as it is, so that an
// UNAVAILABLE expert group stays UNAVAILABLE.
class StatusException : public std::exception {
 public:
  explicit StatusException(absl::Status status)
      : status_(std::move(status)), what_(status_.ToString()) {}
  const absl::Status& status() const { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  absl::Status status_;
  std::string what_;
};

// Runs `fn`, converting a LibTorch c10::Error (or std::exception) into an
// absl::InternalError; a StatusException gives back its own status. Used at
// library boundaries.
absl::Status CatchTorchErrors(const std::function<absl::Status()>& fn);

}  // namespace himoe

#endif  // HIMOE_COMMON_TORCH_RUNTIME_H_
