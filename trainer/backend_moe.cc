#include "trainer/backend_moe.h"

#include <algorithm>
#include <utility>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/profile_scope.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "router_service/routing/dispatch_combine.h"
#include "router_service/routing/routing_math.h"

namespace himoe::trainer {

absl::StatusOr<std::unique_ptr<BackendMoE>> BackendMoE::Create(const model::ModelOptions& o,
                                                               ExpertBackend* experts,
                                                               MicroBatchTurns* turns,
                                                               DataParallel* data_parallel,
                                                               int lanes) {
  HIMOE_RETURN_IF_ERROR(router::ValidateRoutingConfig(o.routing));
  if (experts == nullptr || experts->num_groups() != o.routing.num_groups) {
    return absl::InvalidArgumentError("model: the expert backend must have num_groups groups");
  }
  if (data_parallel != nullptr && (lanes < 1 || lanes > data_parallel->lanes())) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: ", lanes, " micro-batch lanes, the data-parallel groups have ",
                     data_parallel->lanes()));
  }
  std::unique_ptr<BackendMoE> moe(new BackendMoE(o.d_model, experts, turns, data_parallel, lanes));
  for (int m = 0; m < model::NumMoeLayers(o); ++m) {
    router::RouterLayerOptions ro;
    ro.config = o.routing;
    ro.d_model = o.d_model;
    ro.seed = router::RouterSeedFor(o.seed, m);
    ro.init = o.init;
    HIMOE_ASSIGN_OR_RETURN(auto r, router::RouterLayer::Create(ro));
    moe->routers_.push_back(std::move(r));
  }
  moe->next_position_.assign(moe->routers_.size(), std::vector<int64_t>(o.routing.num_groups, 0));
  return moe;
}

absl::StatusOr<router::MoEOutput> BackendMoE::Forward(int layer, const at::Tensor& x,
                                                      const model::MoECall& call) {
  if (layer < 0 || layer >= num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoE layer ", layer, " of ", num_layers(), " does not exist"));
  }
  router::MoEOutput out;
  std::vector<int64_t> positions;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    {
      HIMOE_PROFILE_SCOPE("routing, aux losses");
      MicroBatchTurns* turns = call.training ? turns_ : nullptr;
      if (turns != nullptr) {
        HIMOE_RETURN_IF_ERROR(turns->Wait(Turn::kRoute, layer, call.micro_batch));
      }
      auto routed = call.training ? RouteTraining(layer, x, call)
                                  : routers_[layer]->Route(x, false, call.segments);
      if (routed.ok() && call.training) positions = GradPositions(layer, call.micro_batch, *routed);
      if (turns != nullptr) turns->Pass(Turn::kRoute, layer, call.micro_batch);
      HIMOE_ASSIGN_OR_RETURN(out.routing, std::move(routed));
    }
    // Each token once per group, whatever the number of its experts there.
    std::vector<router::GroupDispatch> distinct(out.routing.groups.size());
    std::vector<GroupRows> groups(out.routing.groups.size());
    {
      HIMOE_PROFILE_SCOPE("dispatch");
      for (size_t g = 0; g < groups.size(); ++g) {
        const router::GroupDispatch& d = out.routing.groups[g];
        router::DistinctTokens once = router::DistinctTokenRows(x.size(0), d);
        distinct[g].token_rows = once.tokens.to(x.device());
        distinct[g].weights = at::ones({once.tokens.size(0)}, x.options());
        groups[g].assignment_rows = std::move(once.rows);
        groups[g].expert_ids = d.expert_ids;
        groups[g].weights = d.weights;
        if (!positions.empty()) groups[g].grad_position = positions[g];
      }
      std::vector<at::Tensor> rows = router::DispatchGroupRows(x, distinct);
      for (size_t g = 0; g < groups.size(); ++g) groups[g].rows = std::move(rows[g]);
    }
    std::vector<at::Tensor> outputs;
    {
      HIMOE_PROFILE_SCOPE("experts");
      HIMOE_ASSIGN_OR_RETURN(
          outputs, experts_->Forward(layer, call.step, call.micro_batch, groups, call.training));
    }
    HIMOE_PROFILE_SCOPE("combine");
    for (at::Tensor& y : outputs) {
      if (!y.defined()) y = at::zeros({0, d_model_}, x.options());
    }
    // The groups' combined rows, each token's summed in group order.
    out.output = router::CombineGroupOutputs(x.size(0), d_model_, distinct, outputs);
    return absl::OkStatus();
  }));
  return out;
}

std::vector<int64_t> BackendMoE::GradPositions(int layer, uint32_t micro_batch,
                                               const router::RoutingOutput& routing) {
  std::vector<int64_t>& next = next_position_[layer];
  // Micro-batch 0 routes each layer first in a step (and in its retry).
  if (micro_batch == 0) std::fill(next.begin(), next.end(), 0);
  std::vector<int64_t> positions(routing.groups.size(), -1);
  for (size_t g = 0; g < routing.groups.size(); ++g) {
    if (routing.groups[g].expert_ids.numel() > 0) positions[g] = next[g]++;
  }
  return positions;
}

absl::StatusOr<router::RoutingOutput> BackendMoE::RouteTraining(int layer, const at::Tensor& x,
                                                                const model::MoECall& call) {
  router::RouterLayer& router = *routers_[layer];
  if (data_parallel_ == nullptr || data_parallel_->world_size() == 1) {
    return router.Route(x, true, call.segments);
  }
  if (!call.segments.empty()) {
    return absl::InvalidArgumentError("model: training across ranks routes whole batches");
  }
  if (x.dim() != 2 || x.size(1) != router.d_model()) {
    return router.Route(x, true);  // its error
  }
  const at::Tensor logits = router::RouterLogits(x, router.gate_weight());
  HIMOE_ASSIGN_OR_RETURN(
      std::vector<at::Tensor> all,
      data_parallel_->AllGather(logits.detach(), static_cast<int>(call.micro_batch % lanes_)));
  const int rank = data_parallel_->rank();
  const auto replay = [&](int begin, int end) -> absl::Status {
    at::NoGradGuard no_grad;
    for (int q = begin; q < end; ++q)
      HIMOE_RETURN_IF_ERROR(router.RouteLogits(all[q], true).status());
    return absl::OkStatus();
  };
  HIMOE_RETURN_IF_ERROR(replay(0, rank));
  absl::StatusOr<router::RoutingOutput> own = router.RouteLogits(logits, true);
  if (!own.ok()) return own.status();
  HIMOE_RETURN_IF_ERROR(replay(rank + 1, static_cast<int>(all.size())));
  return own;
}

absl::Status BackendMoE::LoadExpertState(int group, const std::vector<NamedTensor>& state) {
  if (group < 0 || group >= num_groups()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert group ", group, " of ", num_groups(), " does not exist"));
  }
  return experts_->SetState(group, state);
}

}  // namespace himoe::trainer
