#ifndef HIMOE_ROUTER_SERVICE_ROUTING_ROUTING_STATS_H_
#define HIMOE_ROUTER_SERVICE_ROUTING_ROUTING_STATS_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "router_service/routing/routing_config.h"

namespace himoe::router {

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
  // Collapse diagnostics.
  double mean_pi_sq = 0;                // mean ||pi||^2
  std::vector<double> group_top_share;  // max_{i in g} c_i / L_g, length M
  double top_share = 0;                 // mean of group_top_share
  double load_entropy = 0;              // H(c / sum c) / log N
  std::vector<double> balance_bias;     // the controller's selection bias, length N
  double balance_multiplier = 0;        // mu of the controller's loss
  double lambda_intra = 0;              // the R_intra and R_inter weights this batch used
  double lambda_inter = 0;              // (dual variables when epsilon_ov/epsilon_sys > 0)
};

// The statistics that need only the picks (ids [T, K], kept [T, K]): counts,
// CVs, max violation, shares, entropy, groups per token, capacity and drops.
// What the serving metrics read.
RoutingStats CountStats(const RoutingConfig& config, const at::Tensor& ids,
                        const at::Tensor& kept, int64_t capacity);

// Every statistic: CountStats plus those of the routing distribution `probs`
// [T, N] and the selected weights `sparse` (pi_tilde) [T, N]; `bias` [N] is
// the balance controller's selection bias.
RoutingStats ComputeStats(const RoutingConfig& config, const at::Tensor& probs,
                          const at::Tensor& sparse, const at::Tensor& ids,
                          const at::Tensor& kept, int64_t capacity, const at::Tensor& bias);

// The statistics of several batches routed by the same layer (a validation
// pass): count-based values from the summed counts, the others as
// token-weighted means of the batches' values.
RoutingStats MergeRoutingStats(const RoutingConfig& config,
                               const std::vector<RoutingStats>& batches);

// A tensor's values as doubles, on the host; no gradient.
std::vector<double> ToDoubles(const at::Tensor& t);

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_ROUTING_ROUTING_STATS_H_
