#include "router_service/local_moe.h"

#include <utility>

#include <ATen/ATen.h>

#include "common/status_macros.h"
#include "common/torch_runtime.h"

namespace himoe::router {

uint64_t RouterSeedFor(uint64_t seed, int layer) {
  return seed ^ (0x5851F42D4C957F2Dull * static_cast<uint64_t>(layer + 1));
}

expert::ExpertGroupOptions GroupOptionsFor(const LocalMoEOptions& options,
                                           int group_id) {
  expert::ExpertGroupOptions g;
  g.group_id = group_id;
  g.experts_per_group = options.routing.experts_per_group();
  g.d_model = options.d_model;
  g.d_ff = options.d_ff;
  g.layer = options.layer;
  g.seed = options.seed;
  g.device = options.device;
  g.dtype = options.expert_dtype;
  return g;
}

absl::StatusOr<std::unique_ptr<LocalMoE>> LocalMoE::Create(
    const LocalMoEOptions& options) {
  std::unique_ptr<LocalMoE> moe(new LocalMoE());
  RouterLayerOptions router_options;
  router_options.config = options.routing;
  router_options.d_model = options.d_model;
  router_options.seed = RouterSeedFor(options.seed, options.layer);
  router_options.device = options.device;
  ASSIGN_OR_RETURN(moe->router_, RouterLayer::Create(router_options));
  for (int g = 0; g < options.routing.num_groups; ++g) {
    ASSIGN_OR_RETURN(auto group, expert::ExpertGroup::Create(GroupOptionsFor(options, g)));
    moe->groups_.push_back(std::move(group));
  }
  return moe;
}

absl::StatusOr<MoEOutput> LocalMoE::Forward(const at::Tensor& x, bool training) {
  MoEOutput out;
  ASSIGN_OR_RETURN(out.routing, router_->Route(x, training));
  std::vector<at::Tensor> outputs(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    const GroupDispatch& d = out.routing.groups[g];
    at::Tensor rows;
    RETURN_IF_ERROR(CatchTorchErrors([&] {
      rows = x.index_select(0, d.token_rows);
      return absl::OkStatus();
    }));
    ASSIGN_OR_RETURN(outputs[g], groups_[g]->Forward(rows, d.expert_ids));
  }
  RETURN_IF_ERROR(CatchTorchErrors([&] {
    out.output = CombineGroupOutputs(x.size(0), x.size(1), out.routing.groups, outputs);
    return absl::OkStatus();
  }));
  return out;
}

std::vector<at::Tensor> LocalMoE::parameters() const {
  std::vector<at::Tensor> params = {router_->gate_weight()};
  for (const auto& g : groups_) {
    for (const at::Tensor& p : g->parameters()) params.push_back(p);
  }
  return params;
}

}  // namespace himoe::router
