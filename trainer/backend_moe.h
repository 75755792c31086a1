#ifndef HIMOE_TRAINER_BACKEND_MOE_H_
#define HIMOE_TRAINER_BACKEND_MOE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/named_tensor.h"
#include "model/model_config.h"
#include "model/moe_layers.h"
#include "router_service/routing/local_moe.h"
#include "router_service/routing/router_layer.h"
#include "trainer/data_parallel.h"
#include "trainer/expert_backend.h"
#include "trainer/micro_batch_turns.h"

namespace himoe::trainer {

// The LM's MoE layers for training: the routers here (seeded as LocalMoE's),
// the experts in an ExpertBackend (in-process or on expert-group services).
// Route, send each group its rows, combine.
class BackendMoE final : public model::MoELayers {
 public:
  // `experts` (not owned) must outlive this and have the model's groups.
  // With `turns` (not owned), training micro-batches route each layer in
  // their order (Turn::kRoute), so that several can run at once.
  // With `data_parallel` (not owned) of more than one rank, each training
  // batch's routing moves the routers' state as the batches of every rank
  // would, one after another in rank order (see RouteTraining); micro-batch
  // b uses lane b % lanes of it.
  static absl::StatusOr<std::unique_ptr<BackendMoE>> Create(const model::ModelOptions& options,
                                                            ExpertBackend* experts,
                                                            MicroBatchTurns* turns = nullptr,
                                                            DataParallel* data_parallel = nullptr,
                                                            int lanes = 1);

  int num_layers() const override { return static_cast<int>(routers_.size()); }
  int num_groups() const override { return experts_->num_groups(); }
  absl::StatusOr<router::MoEOutput> Forward(int layer, const at::Tensor& x,
                                            const model::MoECall& call) override;
  router::RouterLayer& router(int layer) override { return *routers_[layer]; }
  absl::Status LoadExpertState(int group, const std::vector<NamedTensor>& state) override;

  ExpertBackend& experts() { return *experts_; }

 private:
  BackendMoE(int64_t d_model, ExpertBackend* experts, MicroBatchTurns* turns,
             DataParallel* data_parallel, int lanes)
      : d_model_(d_model),
        experts_(experts),
        turns_(turns),
        data_parallel_(data_parallel),
        lanes_(lanes) {}

  // Routes a training batch. Across ranks, every rank gathers the logits of
  // the same micro-batch of every rank, routes the others' (no gradient)
  // before and after its own in rank order, and so leaves the routers'
  // state (EMA, controller, dual weights, counts, drop seeds) where one rank
  // routing all those batches in turn would, the same on every rank.
  absl::StatusOr<router::RoutingOutput> RouteTraining(int layer, const at::Tensor& x,
                                                      const model::MoECall& call);
  // Each group's GroupRows::grad_position for a training micro-batch's
  // routing of `layer` (-1: no rows for the group). Called in micro-batch
  // order (the routing turn).
  std::vector<int64_t> GradPositions(int layer, uint32_t micro_batch,
                                     const router::RoutingOutput& routing);

  int64_t d_model_;
  ExpertBackend* experts_;
  MicroBatchTurns* turns_;
  DataParallel* data_parallel_;
  int lanes_;
  std::vector<std::unique_ptr<router::RouterLayer>> routers_;
  // Per layer, per group: the next micro-batch's grad position this step.
  std::vector<std::vector<int64_t>> next_position_;
};

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_BACKEND_MOE_H_
