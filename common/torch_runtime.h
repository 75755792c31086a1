#ifndef HIMOE_COMMON_TORCH_RUNTIME_H_
#define HIMOE_COMMON_TORCH_RUNTIME_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include <c10/core/Device.h>

namespace himoe {

// Sets torch's intra-op thread count and the BLAS's (BLIS_NUM_THREADS;
// OpenBLAS through its API when loaded); `threads` <= 0 means "all cores", and
// then a BLIS_NUM_THREADS already in the environment is kept. Both default to 1 thread here, so every program calls this
// first, before any matmul.
absl::Status ConfigureTorchThreads(int threads);

// Number of CPU cores available to this process.
int DefaultThreadCount();


// Parses "cpu" or "cuda:K"; CUDA devices are refused when LibTorch has no CUDA.
absl::StatusOr<c10::Device> ParseDevice(absl::string_view spec);

// Runs `fn`, converting a LibTorch c10::Error (or std::exception) into an
// absl::InternalError. Used at library boundaries.
absl::Status CatchTorchErrors(const std::function<absl::Status()>& fn);

}  // namespace himoe

#endif  // HIMOE_COMMON_TORCH_RUNTIME_H_
