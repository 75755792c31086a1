#ifndef HIMOE_ROUTER_SERVICE_ROUTER_LAYER_H_
#define HIMOE_ROUTER_SERVICE_ROUTER_LAYER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "router_service/routing_config.h"

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
  at::Tensor Total() const { return load + intra + inter + z; }
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
  int64_t capacity = -1;    // per expert; -1 = dropless
  int64_t dropped = 0;
  double drop_rate = 0;     // dropped / (T*K)
};

struct RoutingOutput {
  at::Tensor expert_ids;  // int64 [T, K]
  at::Tensor weights;     // float [T, K], autograd; renormalized if configured
  at::Tensor kept;        // bool [T, K]: false = dropped by capacity
  at::Tensor probs;       // float [T, N]: the distribution weights come from
  std::vector<GroupDispatch> groups;  // length M
  RoutingLosses losses;
  RoutingStats stats;
};

struct RouterLayerOptions {
  RoutingConfig config;
  int64_t d_model = 0;
  uint64_t seed = 0;
  c10::Device device = c10::Device(c10::kCPU);
};

// One MoE layer's router: the gate W_g (d -> N, no bias, fp32) and its state,
// the logit EMA gbar (himoe) and the per-expert bias b (loss_free).
class RouterLayer {
 public:
  static absl::StatusOr<std::unique_ptr<RouterLayer>> Create(
      const RouterLayerOptions& options);

  // Routes x [T, d]. In training mode the EMA is updated first (himoe) and
  // the expert counts for the loss_free bias update are accumulated.
  absl::StatusOr<RoutingOutput> Route(const at::Tensor& x, bool training);
  // Same, from precomputed logits [T, N].
  absl::StatusOr<RoutingOutput> RouteLogits(const at::Tensor& logits,
                                            bool training);

  // The loss_free update, called after each optimizer step: applies
  // b_i += u*sign(mean c - c_i) on the counts accumulated since the last call
  // and resets them. A no-op for the other methods.
  void ApplyLossFreeBiasUpdate();

  const RoutingConfig& config() const { return config_; }
  int64_t d_model() const { return d_model_; }
  at::Tensor& gate_weight() { return gate_weight_; }  // [N, d], requires grad
  at::Tensor& logit_ema() { return logit_ema_; }      // [N]
  at::Tensor& loss_free_bias() { return loss_free_bias_; }  // [N]
  at::Tensor& pending_counts() { return pending_counts_; }  // [N]

 private:
  RouterLayer(const RoutingConfig& config, int64_t d_model, at::Tensor gate);

  RoutingConfig config_;
  int64_t d_model_;
  at::Tensor gate_weight_;
  at::Tensor logit_ema_;
  at::Tensor loss_free_bias_;
  at::Tensor pending_counts_;
};

// Per-group dispatch plan from a [T, K] selection: group g gets the kept
// assignments whose expert lies in g, sorted by expert id (stable).
std::vector<GroupDispatch> BuildDispatchPlan(const at::Tensor& expert_ids,
                                             const at::Tensor& weights,
                                             const at::Tensor& kept,
                                             int64_t num_groups,
                                             int64_t experts_per_group);

// out[t] = sum over groups and rows of weight * expert_output, [T, d] float.
// `outputs[g]` holds group g's expert outputs, row-aligned with groups[g].
at::Tensor CombineGroupOutputs(int64_t num_tokens, int64_t d_model,
                               const std::vector<GroupDispatch>& groups,
                               const std::vector<at::Tensor>& outputs);

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_ROUTER_LAYER_H_
