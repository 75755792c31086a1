#include "router_service/routing/routing_math.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <ATen/ATen.h>
#include <torch/types.h>

namespace himoe::router {

at::Tensor RouterLogits(const at::Tensor& x, const at::Tensor& gate_weight) {
  return at::matmul(x.to(at::kFloat), gate_weight.to(at::kFloat).t());
}

void UpdateLogitEma(at::Tensor& ema, const at::Tensor& logits, double beta) {
  at::NoGradGuard no_grad;
  ema.mul_(beta).add_(logits.detach().mean(0), 1.0 - beta);
}

at::Tensor CorrectedLogits(const at::Tensor& logits, const at::Tensor& ema,
                           double tau, double temperature) {
  return (logits - tau * ema.detach()) / temperature;
}

at::Tensor CorrectedProbs(const at::Tensor& logits, const at::Tensor& ema,
                          double tau, double temperature) {
  return at::softmax(CorrectedLogits(logits, ema, tau, temperature), -1);
}

Selection SelectFlatTopK(const at::Tensor& scores, int64_t total_k) {
  at::NoGradGuard no_grad;
  Selection s;
  s.ids = std::get<1>(at::topk(scores.detach(), total_k, /*dim=*/1));
  s.rank = at::arange(total_k, s.ids.options()).expand_as(s.ids).contiguous();
  return s;
}

Selection SelectGroupedTopK(const at::Tensor& scores, int64_t num_groups,
                            int64_t k) {
  at::NoGradGuard no_grad;
  const int64_t tokens = scores.size(0);
  const int64_t per_group = scores.size(1) / num_groups;
  const at::Tensor grouped = scores.detach().reshape({tokens, num_groups, per_group});
  // k = 1 (the paper's setting) is an argmax, which needs no sort as topk does.
  const at::Tensor local = k == 1 ? std::get<1>(at::max(grouped, 2, /*keepdim=*/true))
                                  : std::get<1>(at::topk(grouped, k, 2));
  const at::Tensor offset =
      (at::arange(num_groups, local.options()) * per_group).view({1, num_groups, 1});
  Selection s;
  s.ids = (local + offset).reshape({tokens, num_groups * k});
  s.rank = at::arange(k, s.ids.options()).repeat({num_groups}).expand_as(s.ids).contiguous();
  return s;
}

at::Tensor SparseSelectedProbs(const at::Tensor& probs, const at::Tensor& ids) {
  return at::zeros_like(probs).scatter(1, ids, probs.gather(1, ids));
}

at::Tensor RenormalizeWeights(const at::Tensor& weights) {
  return weights / weights.sum(1, /*keepdim=*/true);
}

at::Tensor TokenFractions(const at::Tensor& ids, int64_t num_experts,
                          int64_t num_tokens) {
  at::NoGradGuard no_grad;
  return at::bincount(ids.reshape(-1), {}, num_experts).to(at::kDouble) /
         static_cast<double>(num_tokens);
}

at::Tensor LoadBalancingLoss(const at::Tensor& probs, const at::Tensor& ids,
                             double alpha) {
  const int64_t n = probs.size(1);
  const at::Tensor h =
      TokenFractions(ids, n, probs.size(0)).to(probs.device(), probs.scalar_type());
  const at::Tensor p_mean = probs.mean(0);
  return alpha * static_cast<double>(n) * (h * p_mean).sum();
}

at::Tensor InterGroupRegularizer(const at::Tensor& sparse_probs,
                                 double lambda_inter) {
  return lambda_inter * sparse_probs.pow(2).sum(1).mean();
}

at::Tensor InterGroupRegularizerDenseGroupMass(const at::Tensor& probs,
                                               int64_t num_groups,
                                               double lambda_inter) {
  return lambda_inter * GroupSums(probs, num_groups).pow(2).sum(1).mean();
}

at::Tensor IntraGroupRegularizer(const at::Tensor& probs, double lambda_intra) {
  return -lambda_intra * probs.pow(2).sum(1).mean();
}

at::Tensor RouterZLoss(const at::Tensor& logits, double z_coef) {
  return z_coef * at::logsumexp(logits, {1}).pow(2).mean();
}

int64_t ExpertCapacity(double capacity_factor, int64_t total_k,
                       int64_t num_tokens, int64_t num_experts) {
  if (capacity_factor <= 0) return -1;
  return static_cast<int64_t>(std::ceil(
      capacity_factor * static_cast<double>(total_k * num_tokens) /
      static_cast<double>(num_experts)));
}

int64_t ReleasedExpertCapacity(double capacity_factor, int64_t total_k,
                               int64_t num_tokens, int64_t num_experts,
                               bool round_to_even) {
  if (capacity_factor <= 0) return -1;
  int64_t cap = static_cast<int64_t>(std::floor(
      capacity_factor * static_cast<double>(total_k * num_tokens) /
      static_cast<double>(num_experts)));
  if (round_to_even) cap += cap % 2;
  return std::max<int64_t>(cap, 4);
}

at::Tensor CapacityKeepMask(const Selection& selection, int64_t num_experts,
                            int64_t capacity, const at::Tensor& active) {
  const at::Tensor ids = selection.ids.to(at::kCPU).contiguous();
  if (capacity < 0) {
    return active.defined() ? active.to(selection.ids.device(), at::kBool)
                            : at::ones(ids.sizes(), selection.ids.options().dtype(at::kBool));
  }
  const at::Tensor act = active.defined()
                             ? active.to(at::kCPU, at::kBool).contiguous()
                             : at::ones(ids.sizes(), at::dtype(at::kBool));
  const auto on = act.accessor<bool, 2>();
  const at::Tensor rank = selection.rank.to(at::kCPU).contiguous();
  const int64_t tokens = ids.size(0);
  const int64_t k_total = ids.size(1);
  at::Tensor kept = at::zeros({tokens, k_total}, at::dtype(at::kBool));
  const auto id = ids.accessor<int64_t, 2>();
  const auto rk = rank.accessor<int64_t, 2>();
  auto keep = kept.accessor<bool, 2>();
  const int64_t max_rank = k_total == 0 ? 0 : rank.max().item<int64_t>();
  std::vector<int64_t> used(num_experts, 0);
  for (int64_t r = 0; r <= max_rank; ++r) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < k_total; ++j) {
        if (rk[t][j] != r || !on[t][j]) continue;
        int64_t& u = used[id[t][j]];
        if (u < capacity) {
          ++u;
          keep[t][j] = true;
        }
      }
    }
  }
  return kept.to(selection.ids.device());
}

at::Tensor SecondChoiceActiveMask(const at::Tensor& weights, const at::Tensor& rank,
                                  const at::Tensor& uniform, double threshold) {
  at::NoGradGuard no_grad;
  return rank.eq(0) | uniform.to(weights.device()).lt(weights.detach() / threshold);
}

at::Tensor ReleasedVanillaLoadLoss(const at::Tensor& weights, const at::Tensor& ids,
                                   int64_t num_experts, double alpha) {
  const double tokens = static_cast<double>(ids.size(0));
  const at::Tensor h =
      TokenFractions(ids, num_experts, ids.size(0) * ids.size(1)).to(weights.options());
  const at::Tensor p = at::zeros({num_experts}, weights.options())
                           .index_add(0, ids.reshape(-1), weights.reshape(-1)) /
                       tokens;
  return alpha * static_cast<double>(num_experts) * (h * p).sum();
}

at::Tensor GroupConditionalLoadLoss(const at::Tensor& probs, const at::Tensor& ids,
                                    int64_t num_groups, int64_t k) {
  const int64_t tokens = probs.size(0);
  const int64_t n = probs.size(1);
  const int64_t per_group = n / num_groups;
  const at::Tensor grouped = probs.view({tokens, num_groups, per_group});
  // A group whose mass underflowed to 0 contributes q = 0, not 0/0.
  const at::Tensor q_mean =
      (grouped / grouped.sum(2, /*keepdim=*/true).clamp_min(1e-30)).mean(0);
  const at::Tensor h = TokenFractions(ids, n, tokens * k).to(probs.options());
  return static_cast<double>(per_group) * (h.view({num_groups, per_group}) * q_mean).sum() /
         static_cast<double>(num_groups);
}

std::vector<double> BalanceSolve::Bias() const {
  std::vector<double> b(upper.size());
  for (size_t i = 0; i < b.size(); ++i) {
    b[i] = single_precision
               ? static_cast<double>(static_cast<float>(lower[i]) - static_cast<float>(upper[i]))
               : lower[i] - upper[i];
  }
  return b;
}

void BalanceControllerUpdate(BalanceSolve& solve, const std::vector<int64_t>& counts,
                             double target_cv, double band, double rate) {
  const size_t n = counts.size();
  if (n == 0) return;
  // Integer counts: their double sum is exact in any order.
  const double mean =
      static_cast<double>(std::accumulate(counts.begin(), counts.end(), int64_t{0})) /
      static_cast<double>(n);
  if (mean <= 0) return;
  const double delta = band * target_cv;
  for (size_t i = 0; i < n; ++i) {
    const double x = (static_cast<double>(counts[i]) - mean) / mean;
    const bool flipped = x * solve.last[i] < 0;
    const double step = flipped ? solve.step[i] * 0.5 : std::min(solve.step[i] * 1.2, rate);
    // Each product and sum rounded on its own, as the tensor ops it replaces.
    const double up = step * (x - delta), down = step * (-x - delta);
    solve.upper[i] = solve.Stored(std::max(solve.upper[i] + up, 0.0));
    solve.lower[i] = solve.Stored(std::max(solve.lower[i] + down, 0.0));
    solve.step[i] = solve.Stored(step);
    solve.last[i] = solve.Stored(x);
  }
}

namespace {

template <typename T>
void CountRows(const T* scores, int64_t tokens, int64_t n, const std::vector<double>& bias,
               int64_t num_groups, int64_t k, std::vector<int64_t>& counts) {
  std::vector<T> b(bias.begin(), bias.end());
  std::vector<T> row(n);
  std::vector<char> taken(n);
  const int64_t per_group = n / num_groups;
  if (k == 1) {  // the paper's setting: an argmax per group
    for (int64_t t = 0; t < tokens; ++t) {
      const T* r = scores + t * n;
      for (int64_t first = 0; first < n; first += per_group) {
        int64_t best = first;
        T best_score = r[first] + b[first];
        for (int64_t i = first + 1; i < first + per_group; ++i) {
          const T v = r[i] + b[i];
          if (v > best_score) best_score = v, best = i;
        }
        ++counts[best];
      }
    }
    return;
  }
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < n; ++i) row[i] = scores[t * n + i] + b[i];
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t first = g * per_group, last = first + per_group;
      std::fill(taken.begin() + first, taken.begin() + last, 0);
      for (int64_t pick = 0; pick < k; ++pick) {
        int64_t best = -1;
        for (int64_t i = first; i < last; ++i) {
          if (!taken[i] && (best < 0 || row[i] > row[best])) best = i;
        }
        taken[best] = 1;
        ++counts[best];
      }
    }
  }
}

}  // namespace

std::vector<int64_t> CountSelections(const at::Tensor& scores, const std::vector<double>& bias,
                                     int64_t num_groups, int64_t k) {
  const at::Tensor s = scores.detach().to(at::kCPU).contiguous();
  const int64_t tokens = s.size(0), n = s.size(1);
  TORCH_CHECK(static_cast<int64_t>(bias.size()) == n && num_groups >= 1 && n % num_groups == 0 &&
                  k >= 1 && k <= n / num_groups,
              "CountSelections: scores [T, ", n, "], bias of ", bias.size(), ", ", num_groups,
              " groups, k = ", k);
  std::vector<int64_t> counts(n, 0);
  if (s.scalar_type() == at::kDouble) {
    CountRows(s.data_ptr<double>(), tokens, n, bias, num_groups, k, counts);
  } else {
    TORCH_CHECK(s.scalar_type() == at::kFloat, "CountSelections: scores must be float or double");
    CountRows(s.data_ptr<float>(), tokens, n, bias, num_groups, k, counts);
  }
  return counts;
}

double DualAscentStep(double lambda, double cost, double epsilon, double rate,
                      double upper) {
  return std::min(upper, std::max(0.0, lambda + rate * (cost - epsilon)));
}

void LossFreeBiasUpdate(at::Tensor& bias, const at::Tensor& counts, double u) {
  at::NoGradGuard no_grad;
  const at::Tensor c = counts.to(bias.device(), at::kFloat);
  bias.add_(at::sign(c.mean() - c), u);
}

namespace {

double Mean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / v.size();
}

}  // namespace

double CoefficientOfVariation(const std::vector<double>& load) {
  const double mean = Mean(load);
  if (mean <= 0) return 0.0;
  double var = 0;
  for (const double c : load) var += (c - mean) * (c - mean);
  return std::sqrt(var / load.size()) / mean;
}

double MaxViolation(const std::vector<double>& load) {
  const double mean = Mean(load);
  if (mean <= 0) return 0.0;
  return (*std::max_element(load.begin(), load.end()) - mean) / mean;
}

std::vector<double> TopExpertShares(const std::vector<double>& load, int64_t num_groups) {
  std::vector<double> shares(num_groups, 0.0);
  const size_t per_group = load.size() / num_groups;
  for (int64_t g = 0; g < num_groups; ++g) {
    const auto begin = load.begin() + g * per_group;
    const double total = std::accumulate(begin, begin + per_group, 0.0);
    if (total > 0) shares[g] = *std::max_element(begin, begin + per_group) / total;
  }
  return shares;
}

double NormalizedLoadEntropy(const std::vector<double>& load) {
  const double total = std::accumulate(load.begin(), load.end(), 0.0);
  if (total <= 0 || load.size() < 2) return 0.0;
  double h = 0;
  for (const double c : load) {
    if (c > 0) h -= c / total * std::log(c / total);
  }
  return h / std::log(static_cast<double>(load.size()));
}

at::Tensor GroupSums(const at::Tensor& per_expert, int64_t num_groups) {
  return per_expert.reshape({per_expert.size(0), num_groups, -1}).sum(2);
}

double GroupsPerToken(const at::Tensor& ids, int64_t experts_per_group,
                      int64_t num_groups) {
  at::NoGradGuard no_grad;
  if (ids.size(0) == 0) return 0.0;
  const at::Tensor groups = at::div(ids, experts_per_group, "floor");
  const at::Tensor present =
      at::zeros({ids.size(0), num_groups}, ids.options().dtype(at::kFloat))
          .scatter_(1, groups, 1.0);
  return present.sum(1).mean().item<double>();
}

at::Tensor RoutingOverlap(const at::Tensor& probs) {
  return 1.0 - probs.pow(2).sum(1);
}

double SystemConcentration(const at::Tensor& sparse_probs) {
  at::NoGradGuard no_grad;
  return sparse_probs.detach().pow(2).sum(1).mean().item<double>();
}

Theorem1Certificate ComputeTheorem1Certificate(const at::Tensor& sparse_probs,
                                               int64_t num_groups) {
  at::NoGradGuard no_grad;
  const at::Tensor st = sparse_probs.detach().to(at::kDouble);
  const at::Tensor hat = st / st.sum(1, true);
  const at::Tensor r = GroupSums(hat, num_groups);
  const double m = static_cast<double>(num_groups);
  const double s_max = static_cast<double>(st.size(1) / num_groups);
  Theorem1Certificate cert;
  cert.lhs = m * r.mean(0).pow(2).sum().item<double>();
  cert.rhs = m * s_max * hat.pow(2).sum(1).mean().item<double>();
  const at::Tensor load = r.sum(0).contiguous().to(at::kCPU);
  cert.soft_group_load.assign(load.data_ptr<double>(),
                              load.data_ptr<double>() + load.numel());
  return cert;
}

double CollisionMutualInformation(const at::Tensor& probs) {
  at::NoGradGuard no_grad;
  return std::log(static_cast<double>(probs.size(1)) *
                  probs.detach().pow(2).sum(1).mean().item<double>());
}

}  // namespace himoe::router
