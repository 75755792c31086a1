#ifndef HIMOE_ROUTER_SERVICE_ROUTING_ROUTER_LAYER_H_
#define HIMOE_ROUTER_SERVICE_ROUTING_ROUTER_LAYER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "himoe/v1/model.pb.h"
#include "router_service/routing/routing_config.h"
#include "router_service/routing/routing_math.h"
#include "router_service/routing/routing_stats.h"
#include "router_service/routing/routing_strategy.h"

namespace himoe::router {

struct RouterLayerOptions {
  RoutingConfig config;
  int64_t d_model = 0;
  uint64_t seed = 0;
  c10::Device device = c10::Device(c10::kCPU);
  // The gate: N(0, 0.02) by default; under WEIGHT_INIT_SWITCH SwitchInit_,
  // or for loss_free U(-1/sqrt(d), 1/sqrt(d)) as the released code.
  v1::WeightInit init = v1::WEIGHT_INIT_DEFAULT;
  // Serving (the router service): Route outside training computes no losses
  // (each a constant zero) and only the count statistics (counts, CVs, max
  // violation, shares, entropy, groups per token, capacity, drops), which is
  // what the serving metrics read. The picks and weights are the same.
  bool serving = false;
};

// One MoE layer's router: the gate W_g (d -> N, no bias, fp32) and its state:
// the logit EMA gbar (himoe), the per-expert bias b (loss_free), the balance
// controller's multipliers, the router scale (reference preset, grouped
// methods) and the count of training calls (st_moe's random drop). The
// method itself is a RoutingStrategy (routing_strategy.h).
class RouterLayer {
 public:
  static absl::StatusOr<std::unique_ptr<RouterLayer>> Create(
      const RouterLayerOptions& options);

  // Routes x [T, d]. In training mode the EMA is updated first (himoe) and
  // the expert counts for the bias updates are accumulated. `segments`: the
  // row counts of independent requests merged into x (a serving batch), each
  // >= 1, summing to T; empty = one. Capacity and st_moe's random drop, which
  // depend on the batch, are applied per segment, so that each request is
  // routed as if alone.
  absl::StatusOr<RoutingOutput> Route(const at::Tensor& x, bool training,
                                      const std::vector<int64_t>& segments = {});
  // Same, from precomputed logits [T, N].
  absl::StatusOr<RoutingOutput> RouteLogits(const at::Tensor& logits, bool training,
                                            const std::vector<int64_t>& segments = {});

  // Called after each optimizer step, on the counts accumulated since the
  // last call (with sigmoid scores: the last micro-batch's), then resets
  // them: loss_free's b_i += u*sign(mean c - c_i). A no-op for the other
  // methods (the balance controller updates inside Route).
  void ApplyBiasUpdates();

  const RoutingConfig& config() const { return config_; }
  int64_t d_model() const { return d_model_; }
  at::Tensor& gate_weight() { return gate_weight_; }              // [N, d], requires grad
  at::Tensor& logit_ema() { return state_.logit_ema; }            // [N]
  at::Tensor& loss_free_bias() { return state_.loss_free_bias; }  // [N]
  at::Tensor& pending_counts() { return state_.pending_counts; }  // [N]
  // The balance controller's multipliers (upper, lower, loss_multiplier;
  // step and last exist only during a solve). In training,
  // Route runs the dual ascent on the batch itself, from the multipliers the
  // last batch left, until every expert's load is inside the band (at most
  // kMaxBalanceIterations updates); evaluation and serving use the
  // multipliers as they are.
  BalanceState& balance() { return state_.balance; }
  // b = lower - upper, added to the selection logits when target_expert_cv > 0.
  at::Tensor BalanceBias() const;
  // [1, N], requires grad; undefined unless config().router_scale and grouped.
  at::Tensor& router_scale() { return state_.router_scale; }
  // lambda_intra and lambda_inter, float [1] each: the config's values, moved
  // by dual ascent in training when epsilon_ov / epsilon_sys > 0 (himoe).
  at::Tensor& lambda_intra() { return state_.lambda_intra; }
  at::Tensor& lambda_inter() { return state_.lambda_inter; }
  at::Tensor& route_calls() { return state_.route_calls; }  // int64 [1]

 private:
  RouterLayer(const RoutingConfig& config, int64_t d_model, at::Tensor gate, uint64_t seed,
              bool serving, std::unique_ptr<RoutingStrategy> strategy);

  RoutingConfig config_;
  int64_t d_model_;
  at::Tensor gate_weight_;
  RouterState state_;
  std::unique_ptr<RoutingStrategy> strategy_;  // config_.method's
  bool serving_;
};

// Per-group dispatch plan from a [T, K] selection: group g gets the kept
// assignments whose expert lies in g, sorted by expert id (stable: slots
// ascend within an expert). The groups' tensors are slices of shared ones.
std::vector<GroupDispatch> BuildDispatchPlan(const at::Tensor& expert_ids,
                                             const at::Tensor& weights,
                                             const at::Tensor& kept,
                                             int64_t num_groups,
                                             int64_t experts_per_group);

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_ROUTING_ROUTER_LAYER_H_
