#include "router_service/routing/local_moe.h"

#include <utility>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/expert_shape.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "router_service/routing/dispatch_combine.h"

namespace himoe::router {

uint64_t RouterSeedFor(uint64_t seed, int layer) {
  return seed ^ (0x5851F42D4C957F2Dull * static_cast<uint64_t>(layer + 1));
}

absl::Status CheckExpertsMatchRouting(const v1::ExpertShape& shape, const RoutingConfig& routing,
                                      absl::string_view who) {
  if (shape.num_experts() == routing.num_experts && shape.num_groups() == routing.num_groups) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      who, ": the experts have N=", shape.num_experts(), ", M=", shape.num_groups(),
      "; the routing config has N=", routing.num_experts, ", M=", routing.num_groups));
}

absl::StatusOr<std::unique_ptr<LocalMoE>> LocalMoE::Create(
    const LocalMoEOptions& options) {
  const v1::ExpertShape& shape = options.shape;
  HIMOE_RETURN_IF_ERROR(ValidateExpertShape(shape));
  HIMOE_RETURN_IF_ERROR(CheckExpertsMatchRouting(shape, options.routing, "LocalMoE"));
  if (options.layer < 0 || options.layer >= shape.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("LocalMoE: layer ", options.layer,
                                                   " is outside [0, ", shape.num_layers(), ")"));
  }
  std::unique_ptr<LocalMoE> moe(new LocalMoE());
  RouterLayerOptions router_options;
  router_options.config = options.routing;
  router_options.d_model = shape.d_model();
  router_options.seed = RouterSeedFor(shape.seed(), options.layer);
  router_options.device = options.device;
  router_options.init = shape.init();
  HIMOE_ASSIGN_OR_RETURN(moe->router_, RouterLayer::Create(router_options));
  for (int g = 0; g < shape.num_groups(); ++g) {
    HIMOE_ASSIGN_OR_RETURN(auto group,
                           expert::ExpertGroup::Create(shape, g, options.layer, options.device));
    moe->groups_.push_back(std::move(group));
  }
  return moe;
}

absl::StatusOr<MoEOutput> LocalMoE::Forward(const at::Tensor& x, bool training) {
  MoEOutput out;
  HIMOE_ASSIGN_OR_RETURN(out.routing, router_->Route(x, training));
  std::vector<at::Tensor> rows;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    rows = DispatchGroupRows(x, out.routing.groups);
    return absl::OkStatus();
  }));
  std::vector<at::Tensor> outputs(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    HIMOE_ASSIGN_OR_RETURN(outputs[g],
                           groups_[g]->Forward(rows[g], out.routing.groups[g].expert_ids));
  }
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
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
