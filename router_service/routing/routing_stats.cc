#include "router_service/routing/routing_stats.h"

#include <ATen/ATen.h>

#include "router_service/routing/routing_math.h"

namespace himoe::router {
namespace {

// The count-based statistics of `s` from its counts.
void FillCountStats(const RoutingConfig& c, RoutingStats& s) {
  s.expert_cv = CoefficientOfVariation(s.expert_counts);
  s.group_cv = CoefficientOfVariation(s.group_counts);
  s.max_vio = MaxViolation(s.expert_counts);
  s.group_top_share = TopExpertShares(s.expert_counts, c.num_groups);
  s.top_share = 0;
  for (const double share : s.group_top_share) s.top_share += share / c.num_groups;
  s.load_entropy = NormalizedLoadEntropy(s.expert_counts);
}

// Adds `b`'s counts to `s`'s.
void AddCounts(const RoutingConfig& c, const RoutingStats& b, RoutingStats& s) {
  for (int i = 0; i < c.num_experts && i < static_cast<int>(b.expert_counts.size()); ++i) {
    s.expert_counts[i] += b.expert_counts[i];
  }
  for (int g = 0; g < c.num_groups && g < static_cast<int>(b.group_counts.size()); ++g) {
    s.group_counts[g] += b.group_counts[g];
    if (g < static_cast<int>(b.soft_group_load.size())) s.soft_group_load[g] += b.soft_group_load[g];
  }
}

}  // namespace

std::vector<double> ToDoubles(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

RoutingStats CountStats(const RoutingConfig& c, const at::Tensor& ids, const at::Tensor& kept,
                        int64_t capacity) {
  at::NoGradGuard no_grad;
  RoutingStats s;
  s.tokens = ids.size(0);
  const at::Tensor counts = at::bincount(ids.reshape(-1), {}, c.num_experts);
  s.expert_counts = ToDoubles(counts);
  s.group_counts.assign(c.num_groups, 0.0);
  for (int e = 0; e < c.num_experts; ++e) {
    s.group_counts[e / c.experts_per_group()] += s.expert_counts[e];
  }
  FillCountStats(c, s);
  s.groups_per_token = GroupsPerToken(ids, c.experts_per_group(), c.num_groups);
  s.capacity = capacity;
  s.dropped = kept.numel() - kept.sum().item<int64_t>();
  s.drop_rate = kept.numel() == 0 ? 0.0
                                  : static_cast<double>(s.dropped) / kept.numel();
  return s;
}

RoutingStats ComputeStats(const RoutingConfig& c, const at::Tensor& probs,
                          const at::Tensor& sparse, const at::Tensor& ids,
                          const at::Tensor& kept, int64_t capacity,
                          const at::Tensor& bias) {
  at::NoGradGuard no_grad;
  RoutingStats s = CountStats(c, ids, kept, capacity);
  s.soft_group_load = ToDoubles(GroupSums(probs.detach(), c.num_groups).sum(0));
  s.mean_pi_sq = probs.detach().pow(2).sum(1).mean().item<double>();
  s.c_ov = 1.0 - s.mean_pi_sq;  // mean of RoutingOverlap
  s.c_sys = SystemConcentration(sparse);
  const Theorem1Certificate cert = ComputeTheorem1Certificate(sparse, c.num_groups);
  s.cert_lhs = cert.lhs;
  s.cert_rhs = cert.rhs;
  s.collision_mi = CollisionMutualInformation(probs);
  s.balance_bias = ToDoubles(bias);
  return s;
}

RoutingStats MergeRoutingStats(const RoutingConfig& c,
                               const std::vector<RoutingStats>& batches) {
  RoutingStats s;
  s.expert_counts.assign(c.num_experts, 0.0);
  s.group_counts.assign(c.num_groups, 0.0);
  s.soft_group_load.assign(c.num_groups, 0.0);
  int64_t assignments = 0;
  for (const RoutingStats& b : batches) s.tokens += b.tokens;
  for (const RoutingStats& b : batches) {
    AddCounts(c, b, s);
    const double w = s.tokens > 0 ? static_cast<double>(b.tokens) / s.tokens : 0.0;
    s.groups_per_token += w * b.groups_per_token;
    s.mean_pi_sq += w * b.mean_pi_sq;
    s.c_ov += w * b.c_ov;
    s.c_sys += w * b.c_sys;
    s.cert_lhs += w * b.cert_lhs;
    s.cert_rhs += w * b.cert_rhs;
    s.collision_mi += w * b.collision_mi;
    s.capacity = b.capacity;
    s.dropped += b.dropped;
    assignments += b.tokens * c.total_k();
    s.balance_bias = b.balance_bias;
    s.balance_multiplier = b.balance_multiplier;
    s.lambda_intra = b.lambda_intra;
    s.lambda_inter = b.lambda_inter;
  }
  FillCountStats(c, s);
  s.drop_rate = assignments > 0 ? static_cast<double>(s.dropped) / assignments : 0.0;
  return s;
}

}  // namespace himoe::router
