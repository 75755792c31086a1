#ifndef HIMOE_MODEL_MOE_LAYERS_H_
#define HIMOE_MODEL_MOE_LAYERS_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/named_tensor.h"
#include "router_service/routing/local_moe.h"
#include "router_service/routing/router_layer.h"

namespace himoe::model {

// What one MoE-layer call is part of. Training calls key the experts' saved
// state by (step, micro_batch, layer); inference calls keep none.
struct MoECall {
  uint64_t step = 0;
  uint32_t micro_batch = 0;
  bool training = false;
  // Rows of independent sequences in x (streams decoded together), each
  // routed as if alone (RouterLayer::Route); empty = one.
  std::vector<int64_t> segments;
};

// The LM's MoE layers: for each MoE layer, its router and its experts,
// wherever those live. Implemented for training on an expert backend
// (trainer/backend_moe.h: in-process or remote groups) and for serving on the
// router's own dispatch path (router_service/batched_moe.h: batching,
// failover, metrics).
class MoELayers {
 public:
  virtual ~MoELayers() = default;

  virtual int num_layers() const = 0;
  virtual int num_groups() const = 0;

  // y = sum over the selected experts of weight * expert(x) for x [T, d];
  // output [T, d] float32. With call.training: differentiable w.r.t. x, the
  // gate and the experts, and routing.losses/stats describe this batch.
  // Otherwise routing.losses may be undefined tensors.
  virtual absl::StatusOr<router::MoEOutput> Forward(int layer, const at::Tensor& x,
                                                    const MoECall& call) = 0;

  // Layer `layer`'s router: gate, logit EMA, loss_free bias. The LM registers
  // these tensors as its own (moe<l>_gate, ...), so a checkpoint restores them.
  virtual router::RouterLayer& router(int layer) = 0;

  // Replaces group `group`'s expert weights (and optimizer state, where the
  // names hold any); names as ExpertServiceCore::GetState.
  virtual absl::Status LoadExpertState(int group, const std::vector<NamedTensor>& state) = 0;
};

}  // namespace himoe::model

#endif  // HIMOE_MODEL_MOE_LAYERS_H_
