#ifndef HIMOE_ROUTER_SERVICE_ROUTING_ROUTER_LAYER_H_
#define HIMOE_ROUTER_SERVICE_ROUTING_ROUTER_LAYER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/TensorOperators.h>  // Total()'s +
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "himoe/v1/model.pb.h"
#include "router_service/routing/routing_config.h"
#include "router_service/routing/routing_math.h"

namespace himoe::router {

// The tokens one expert group computes. Rows are sorted by expert id.
struct GroupDispatch {
  at::Tensor token_rows;  // int64 [n]: rows of the layer input
  at::Tensor expert_ids;  // int64 [n]: global expert ids, all in this group
  at::Tensor weights;     // float [n]: combine weights (autograd)
  at::Tensor slots;       // int64 [n]: flat index t*K + j of the assignment
};

// Every term is a scalar autograd tensor; a term the method does not use is
// a constant zero.
struct RoutingLosses {
  at::Tensor load;
  at::Tensor intra;
  at::Tensor inter;
  at::Tensor z;
  at::Tensor balance;  // the balance controller's learned part (grouped methods)
  at::Tensor Total() const { return load + intra + inter + z + balance; }
};

// Balance/specialization statistics of one batch (shared/spec, "Balance and
// specialization statistics"). Counts are of selected assignments, before
// capacity drops.
struct RoutingStats {
  int64_t tokens = 0;
  std::vector<double> expert_counts;    // c_i, length N
  std::vector<double> group_counts;     // L_g, length M
  std::vector<double> soft_group_load;  // sum_x p(g|x) with p = routing probs
  double expert_cv = 0;
  double group_cv = 0;
  double max_vio = 0;
  double groups_per_token = 0;
  double c_ov = 0;   // mean(1 - ||pi||^2)
  double c_sys = 0;  // mean ||pi_tilde||^2
  double cert_lhs = 0;  // CV_group^2 + 1 = M ||rbar||^2      (Theorem 1)
  double cert_rhs = 0;  // M S_max mean ||pi_tilde_normalized||^2
  double collision_mi = 0;  // I_2 = log(N mean ||pi||^2)
  int64_t capacity = -1;    // per expert (the largest segment's); -1 = dropless
  int64_t dropped = 0;      // capacity drops and st_moe's second-choice drops
  double drop_rate = 0;     // dropped / (T*K)
  // Collapse diagnostics (issue #10).
  double mean_pi_sq = 0;                // mean ||pi||^2
  std::vector<double> group_top_share;  // max_{i in g} c_i / L_g, length M
  double top_share = 0;                 // mean of group_top_share
  double load_entropy = 0;              // H(c / sum c) / log N
  std::vector<double> balance_bias;     // the controller's selection bias, length N
  double balance_multiplier = 0;        // mu of the controller's loss
  double lambda_intra = 0;              // the R_intra and R_inter weights this batch used
  double lambda_inter = 0;              // (dual variables when epsilon_ov/epsilon_sys > 0)
};

// The statistics of several batches routed by the same layer (a validation
// pass): count-based values from the summed counts, the others as
// token-weighted means of the batches' values.
RoutingStats MergeRoutingStats(const RoutingConfig& config,
                               const std::vector<RoutingStats>& batches);

struct RoutingOutput {
  at::Tensor expert_ids;  // int64 [T, K]
  at::Tensor weights;     // float [T, K], autograd; renormalized if configured
  at::Tensor kept;        // bool [T, K]: false = dropped by capacity
  at::Tensor probs;       // float [T, N]: the distribution weights come from
  std::vector<GroupDispatch> groups;  // length M
  RoutingLosses losses;
  RoutingStats stats;
};

// Dual-ascent updates the controller may spend on one training batch.
inline constexpr int kMaxBalanceIterations = 50;

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
// methods) and the count of training calls (st_moe's random drop).
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
  at::Tensor& gate_weight() { return gate_weight_; }  // [N, d], requires grad
  at::Tensor& logit_ema() { return logit_ema_; }      // [N]
  at::Tensor& loss_free_bias() { return loss_free_bias_; }  // [N]
  at::Tensor& pending_counts() { return pending_counts_; }  // [N]
  // The balance controller's multipliers (upper, lower, loss_multiplier;
  // step and last exist only during a solve). In training,
  // Route runs the dual ascent on the batch itself, from the multipliers the
  // last batch left, until every expert's load is inside the band (at most
  // kMaxBalanceIterations updates); evaluation and serving use the
  // multipliers as they are.
  BalanceState& balance() { return balance_; }
  // b = lower - upper, added to the selection logits when target_expert_cv > 0.
  at::Tensor BalanceBias() const;
  // [1, N], requires grad; undefined unless config().router_scale and grouped.
  at::Tensor& router_scale() { return router_scale_; }
  // lambda_intra and lambda_inter, float [1] each: the config's values, moved
  // by dual ascent in training when epsilon_ov / epsilon_sys > 0 (himoe).
  at::Tensor& lambda_intra() { return lambda_intra_; }
  at::Tensor& lambda_inter() { return lambda_inter_; }
  at::Tensor& route_calls() { return route_calls_; }  // int64 [1]

 private:
  RouterLayer(const RoutingConfig& config, int64_t d_model, at::Tensor gate, uint64_t seed,
              bool serving);
  // Top-k inside every group (grouped methods) or top-K over all N.
  Selection Select(const at::Tensor& scores) const;
  // The controller's training-time selection on the logits of pi.
  Selection SelectWithinBand(const at::Tensor& logits);
  // The seed of st_moe's second-choice draws: one stream per training call,
  // a fixed one outside training.
  uint64_t DropSeed(bool training);

  RoutingConfig config_;
  int64_t d_model_;
  at::Tensor gate_weight_;
  at::Tensor logit_ema_;
  at::Tensor loss_free_bias_;
  at::Tensor pending_counts_;
  BalanceState balance_;
  at::Tensor router_scale_;
  at::Tensor lambda_intra_;
  at::Tensor lambda_inter_;
  at::Tensor route_calls_;
  uint64_t seed_;
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
