#ifndef HIMOE_ROUTER_SERVICE_BATCHED_MOE_H_
#define HIMOE_ROUTER_SERVICE_BATCHED_MOE_H_

#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "model/moe_layers.h"
#include "router_service/batcher.h"
#include "router_service/remote_moe.h"

namespace himoe::router {

// The router's MoE layers as the LM it serves sees them: every layer call goes
// through the same Batcher as RouteForward (so concurrent Generate and
// RouteForward calls share batches), then RemoteMoE (replica failover,
// metrics). A call's rows are one caller-made batch (Batcher::SubmitBatched):
// it starts at once, not after max_queue_delay. Inference only. `moe` and
// `batcher` must outlive this.
class BatchedMoE final : public model::MoELayers {
 public:
  BatchedMoE(RemoteMoE* moe, Batcher* batcher) : moe_(moe), batcher_(batcher) {}

  int num_layers() const override { return moe_->num_layers(); }
  int num_groups() const override { return moe_->num_groups(); }
  // routing holds expert_ids and weights only (no losses: a batch may mix
  // callers).
  absl::StatusOr<MoEOutput> Forward(int layer, const at::Tensor& x,
                                    const model::MoECall& call) override;
  RouterLayer& router(int layer) override { return moe_->router(layer); }
  absl::Status LoadExpertState(int group, const std::vector<NamedTensor>& state) override {
    return moe_->LoadExpertState(group, state);
  }

 private:
  RemoteMoE* moe_;
  Batcher* batcher_;
};

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_BATCHED_MOE_H_
