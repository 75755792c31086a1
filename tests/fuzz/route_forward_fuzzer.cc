// The router's RouteForward decode path on arbitrary bytes parsed as a
// RouteForwardRequest: INVALID_ARGUMENT or finite [T, d_model] rows with
// 1 <= T <= the limit, never a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include <ATen/ATen.h>

#include "absl/status/status.h"
#include "himoe/v1/router.pb.h"
#include "router_service/router_grpc_service.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  himoe::v1::RouteForwardRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  constexpr int64_t kDModel = 8, kMaxTokens = 64;
  auto hidden = himoe::router::DecodeHidden(&request, kDModel, kMaxTokens);
  if (!hidden.ok()) {
    if (!absl::IsInvalidArgument(hidden.status())) std::abort();
    return 0;
  }
  if (hidden->dim() != 2 || hidden->size(1) != kDModel || hidden->size(0) < 1 ||
      hidden->size(0) > kMaxTokens || !at::isfinite(*hidden).all().item<bool>()) {
    std::abort();
  }
  return 0;
}
