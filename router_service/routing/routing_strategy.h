#ifndef HIMOE_ROUTER_SERVICE_ROUTING_ROUTING_STRATEGY_H_
#define HIMOE_ROUTER_SERVICE_ROUTING_ROUTING_STRATEGY_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/TensorOperators.h>  // Total()'s +
#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "router_service/routing/routing_config.h"
#include "router_service/routing/routing_math.h"
#include "router_service/routing/routing_stats.h"

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

// One router layer's state besides the gate, which the strategies read and
// update in place (the model registers these tensors as its own).
struct RouterState {
  at::Tensor logit_ema;       // [N]: gbar (himoe)
  at::Tensor loss_free_bias;  // [N]: b (loss_free)
  at::Tensor pending_counts;  // [N]: counts for the next bias update (loss_free)
  BalanceState balance;       // the balance controller's multipliers
  at::Tensor router_scale;    // [1, N], requires grad; undefined unless enabled
  at::Tensor lambda_intra;    // float [1]: R_intra's weight (moved under a budget)
  at::Tensor lambda_inter;    // float [1]: R_inter's weight (moved under a budget)
  at::Tensor route_calls;     // int64 [1]: training calls (st_moe's random drop)
  uint64_t seed = 0;          // of st_moe's second-choice draws
  // b = lower - upper, the controller's selection bias.
  at::Tensor BalanceBias() const;
};

// How one routing method turns a batch's logits into picks, combine weights,
// drops, auxiliary losses and statistics. One implementation per
// RoutingMethod; see MakeRoutingStrategy.
class RoutingStrategy {
 public:
  virtual ~RoutingStrategy() = default;

  // Routes logits [T, N] (checked by the caller; fp32, or double kept as
  // double) and updates `state`. `segments`: the row counts of independent
  // requests, each >= 1, summing to T (non-empty); capacity and random drops
  // apply per segment. `serving`: outside training, compute no losses (each
  // a constant zero) and only the count statistics. Leaves `groups` empty.
  virtual RoutingOutput Route(const at::Tensor& logits, bool training, bool serving,
                              std::vector<int64_t> segments, RouterState& state) const = 0;

  // Called after each optimizer step (loss_free's bias update from the
  // pending counts, which it then resets); a no-op for the other methods.
  virtual void ApplyBiasUpdates(RouterState& state) const = 0;
};

// The strategy of config.method, after ValidateRoutingConfig.
absl::StatusOr<std::unique_ptr<RoutingStrategy>> MakeRoutingStrategy(
    const RoutingConfig& config);

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_ROUTING_ROUTING_STRATEGY_H_
