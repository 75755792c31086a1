#include "router_service/batched_moe.h"

#include <utility>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"

namespace himoe::router {

absl::StatusOr<MoEOutput> BatchedMoE::Forward(int layer, const at::Tensor& x,
                                              const model::MoECall& call) {
  if (call.training) {
    return absl::FailedPreconditionError("the router's MoE layers serve inference only");
  }
  if (layer < 0 || layer >= num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer: ", layer, " is not served; layers are [0, ", num_layers(), ")"));
  }
  at::Tensor input;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    input = x.detach().to(at::kFloat).contiguous();
    return absl::OkStatus();
  }));
  absl::Notification done;
  absl::StatusOr<LayerResult> result;
  batcher_->Submit(layer, std::move(input), [&](absl::StatusOr<LayerResult> r) {
    result = std::move(r);
    done.Notify();
  });
  done.WaitForNotification();
  if (!result.ok()) return result.status();
  MoEOutput out;
  out.output = std::move(result->output);
  out.routing.expert_ids = std::move(result->expert_ids);
  out.routing.weights = std::move(result->weights);
  return out;
}

}  // namespace himoe::router
