#include "router_service/batched_moe.h"

#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/countdown.h"
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
  // Each segment is its own batcher request, so the batcher routes each as
  // if alone (and may merge them with other traffic). They are this step's
  // whole batch, so it starts without waiting for company.
  std::vector<int64_t> segments = call.segments;
  if (segments.empty()) segments.push_back(input.size(0));
  const size_t n = segments.size();
  std::vector<absl::StatusOr<LayerResult>> results(n, absl::UnknownError("not answered"));
  Countdown pending(static_cast<int>(n));
  std::vector<at::Tensor> rows;
  std::vector<Batcher::Done> dones;
  int64_t offset = 0;
  for (size_t i = 0; i < n; ++i) {
    rows.push_back(n == 1 ? input : input.narrow(0, offset, segments[i]));
    offset += segments[i];
    dones.push_back([&results, &pending, i](absl::StatusOr<LayerResult> r) {
      results[i] = std::move(r);
      pending.Done();
    });
  }
  batcher_->SubmitBatched(layer, std::move(rows), std::move(dones));
  pending.Wait();
  std::vector<at::Tensor> outputs, ids, weights;
  for (absl::StatusOr<LayerResult>& r : results) {
    if (!r.ok()) return r.status();
    outputs.push_back(std::move(r->output));
    ids.push_back(std::move(r->expert_ids));
    weights.push_back(std::move(r->weights));
  }
  MoEOutput out;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    out.output = n == 1 ? outputs[0] : at::cat(outputs);
    out.routing.expert_ids = n == 1 ? ids[0] : at::cat(ids);
    out.routing.weights = n == 1 ? weights[0] : at::cat(weights);
    return absl::OkStatus();
  }));
  return out;
}

}  // namespace himoe::router
