#ifndef HIMOE_ROUTER_SERVICE_ROUTING_ROUTING_MATH_H_
#define HIMOE_ROUTER_SERVICE_ROUTING_ROUTING_MATH_H_

// The formulas of shared/spec/routing-math.md, one function each. Inputs are
// [T, N] tensors (T tokens, N experts) unless stated. Everything is
// autograd-transparent except where marked "no gradient".

#include <cstdint>
#include <limits>
#include <vector>

#include <ATen/core/Tensor.h>

namespace himoe::router {

// g(x) = W_g x: router logits [T, N] from x [T, d] and W_g [N, d], in fp32.
at::Tensor RouterLogits(const at::Tensor& x, const at::Tensor& gate_weight);

// gbar <- beta*gbar + (1-beta)*mean_tokens(g(x)), in place, no gradient.
// (Bias correction, paper Sec. 3.3; done before the EMA is used.)
void UpdateLogitEma(at::Tensor& ema, const at::Tensor& logits, double beta);

// (g(x) - tau*gbar) / T: the logits of pi. (Bias-corrected routing, Sec. 3.3.)
at::Tensor CorrectedLogits(const at::Tensor& logits, const at::Tensor& ema,
                           double tau, double temperature);

// pi(x) = softmax((g(x) - tau*gbar) / T). (Bias-corrected routing, Sec. 3.3.)
at::Tensor CorrectedProbs(const at::Tensor& logits, const at::Tensor& ema,
                          double tau, double temperature);

// Top-K selection. ids [T, K] int64; rank [T, K] int64 is the choice order
// used for capacity: the position among the K picks for flat routing, the
// position inside the group's k picks for grouped routing.
struct Selection {
  at::Tensor ids;
  at::Tensor rank;
};
// Top-K over all N experts (vanilla, st_moe, loss_free), eq. (standard_moe).
Selection SelectFlatTopK(const at::Tensor& scores, int64_t total_k);
// Top-k inside each of M groups, columns group-major (moge, himoe); the
// grouped-MoE equation of Sec. 3.
Selection SelectGroupedTopK(const at::Tensor& scores, int64_t num_groups,
                            int64_t k);

// pi_tilde(x): pi at the selected experts, zero elsewhere, [T, N]. Eq. (topk_pi).
at::Tensor SparseSelectedProbs(const at::Tensor& probs, const at::Tensor& ids);

// Weights of the K selected experts divided by their sum over all K.
at::Tensor RenormalizeWeights(const at::Tensor& weights);

// h_i: fraction of tokens that selected expert i (sum_i h_i = K); no gradient.
at::Tensor TokenFractions(const at::Tensor& ids, int64_t num_experts,
                          int64_t num_tokens);

// L_load = alpha * N * sum_i h_i * P_i with P_i = mean_tokens probs_i. Eq. (loss).
at::Tensor LoadBalancingLoss(const at::Tensor& probs, const at::Tensor& ids,
                             double alpha);

// R_inter = lambda_inter * mean_tokens ||pi_tilde(x)||^2. Eq. (r_inter).
at::Tensor InterGroupRegularizer(const at::Tensor& sparse_probs,
                                 double lambda_inter);

// Released-code R_inter: lambda * mean_tokens sum_g (sum_{i in g} p_i)^2.
at::Tensor InterGroupRegularizerDenseGroupMass(const at::Tensor& probs,
                                               int64_t num_groups,
                                               double lambda_inter);

// R_intra = -lambda_intra * mean_tokens ||pi(x)||^2. Eq. (r_intra).
at::Tensor IntraGroupRegularizer(const at::Tensor& probs, double lambda_intra);

// ST-MoE z-loss = c_z * mean_tokens (logsumexp g(x))^2.
at::Tensor RouterZLoss(const at::Tensor& logits, double z_coef);

// cap = ceil(capacity_factor * K * T / N); capacity_factor <= 0 = no limit
// (returns -1).
int64_t ExpertCapacity(double capacity_factor, int64_t total_k,
                       int64_t num_tokens, int64_t num_experts);

// Released-code capacity: floor(capacity_factor * K * T / N), plus one when
// odd if `round_to_even` (all routers but loss_free), then at least 4;
// capacity_factor <= 0 = no limit (-1).
int64_t ReleasedExpertCapacity(double capacity_factor, int64_t total_k,
                               int64_t num_tokens, int64_t num_experts,
                               bool round_to_even);

// Keeps assignments in priority order (every rank-0 choice before any rank-1
// choice, then by token index) while the expert has room. kept [T, K] bool.
// Assignments where `active` [T, K] bool (optional) is false are not kept
// and take no room.
at::Tensor CapacityKeepMask(const Selection& selection, int64_t num_experts,
                            int64_t capacity, const at::Tensor& active = {});

// st_moe (released code): a pick of rank >= 1 stays with probability
// min(1, weight / threshold), one uniform draw u [T, K] per pick:
// active = rank == 0 || u < weight / threshold. [T, K] bool.
at::Tensor SecondChoiceActiveMask(const at::Tensor& weights, const at::Tensor& rank,
                                  const at::Tensor& uniform, double threshold);

// Released vanilla load loss: alpha * N * sum_i h_i * P_i with
// h_i = c_i / (T*K) and P_i = (sum of the selected weights of expert i) / T.
at::Tensor ReleasedVanillaLoadLoss(const at::Tensor& weights, const at::Tensor& ids,
                                   int64_t num_experts, double alpha);

// loss_free: b_i <- b_i + u * sign(mean_j c_j - c_i), in place, no gradient.
void LossFreeBiasUpdate(at::Tensor& bias, const at::Tensor& counts, double u);

// The balance controller's learned part: the load loss of the group-
// conditional distribution, q_i(x) = pi_i(x) / sum_{j in g} pi_j(x) for i in
// group g, so its push on an expert does not fade with the group's share of
// the token's mass (the spec's "Known behaviour"):
//   (1/M) * sum_g S * sum_{i in g} h_i * Q_i,  h_i = c_i / (T*k)  (no gradient),
// Q_i = mean_tokens q_i. 1 when balanced. `ids` [T, M*k] grouped picks.
at::Tensor GroupConditionalLoadLoss(const at::Tensor& probs, const at::Tensor& ids,
                                    int64_t num_groups, int64_t k);

// Balance controller: projected dual ascent on the per-expert load band
// (1-delta)*cbar <= c_i <= (1+delta)*cbar, cbar = mean c, delta = band * target.
// With x_i = (c_i - cbar)/cbar, the multipliers of the upper and lower
// constraints move by
//   upper_i <- max(0, upper_i + step_i * (x_i - delta)),
//   lower_i <- max(0, lower_i + step_i * (-x_i - delta)),
// and the selection bias is b = lower - upper: the Lagrangian of the balanced
// assignment (each token picks top-k of its scores, loads within the band)
// picks top-k of score + b. Tokens whose scores nearly tie make the loads a
// steep function of b, so a fixed step overshoots and the load flips between
// experts from step to step; each expert's step therefore halves when x_i
// changes sign and grows by 1.2x (up to `rate`) while it keeps it (Rprop's
// rule). `last` holds the previous x. In place, no gradient; a no-op for
// all-zero counts. The solve runs on host vectors: a batch takes up to
// kMaxBalanceIterations updates of N numbers each, where tensor ops would
// cost more in dispatch than in arithmetic.
struct BalanceState {
  at::Tensor upper, lower;  // [N] each, the multipliers
  // mu of the group-conditional load loss, [1]: projected dual ascent on the
  // CV of the gate's own picks (without the bias),
  // mu <- max(0, mu + kBalanceLossRate * (CV_gate - target)).
  at::Tensor loss_multiplier;
};
// One batch's solve: the multipliers as BalanceState holds them, the step
// sizes and the previous x. Computed in double; with `single_precision`
// every stored value is rounded to float, as a float BalanceState stores it.
struct BalanceSolve {
  std::vector<double> upper, lower, step, last;
  bool single_precision = true;
  // `v` as the state stores it.
  double Stored(double v) const {
    return single_precision ? static_cast<double>(static_cast<float>(v)) : v;
  }
  // The selection bias b = lower - upper, subtracted in the state's dtype
  // (RouterLayer::BalanceBias).
  std::vector<double> Bias() const;
};
void BalanceControllerUpdate(BalanceSolve& solve, const std::vector<int64_t>& counts,
                             double target_cv, double band, double rate);

// How many of the T tokens pick each expert when selecting on scores + bias
// (as SelectGroupedTopK with `num_groups`, or SelectFlatTopK with
// num_groups = 1; ties go to the lower index, as at::max's): [N]. `scores`
// [T, N] float or double, any device; `bias` [N] is added in the scores'
// dtype.
std::vector<int64_t> CountSelections(const at::Tensor& scores, const std::vector<double>& bias,
                                     int64_t num_groups, int64_t k);

// Projected dual ascent on one constraint C <= epsilon of the paper's
// constrained problem (eq. main:constrained, whose Lagrange multipliers are
// lambda_inter and lambda_intra), and on the controller's CV <= target:
//   lambda <- min(upper, max(0, lambda + rate * (C - epsilon))).
// A finite `upper` bounds the multiplier to a box (the penalty never exceeds
// upper * violation, as with a fixed weight).
double DualAscentStep(double lambda, double cost, double epsilon, double rate,
                      double upper = std::numeric_limits<double>::infinity());

// ---- Statistics (no gradient; plain numbers for metrics) ----

// CV = std(c)/mean(c), population std. Eq. (load). 0 for an all-zero load.
double CoefficientOfVariation(const std::vector<double>& load);

// MaxVio = (max_i c_i - mean c) / mean c (loss-free paper's imbalance metric).
double MaxViolation(const std::vector<double>& load);

// Each group's top expert's share of the group's load, max_{i in g} c_i / L_g
// (1/S balanced, 1 collapsed; 0 for an empty group), length M.
std::vector<double> TopExpertShares(const std::vector<double>& load, int64_t num_groups);

// Entropy of the load distribution c / sum c, divided by log N: 1 = uniform,
// 0 = one expert takes everything (and for an all-zero load or N = 1).
double NormalizedLoadEntropy(const std::vector<double>& load);

// Mean over tokens of the number of distinct groups among the token's picks.
double GroupsPerToken(const at::Tensor& ids, int64_t experts_per_group,
                      int64_t num_groups);

// Per-token overlap sum_{i != j} pi_i pi_j = 1 - ||pi||^2, [T].
// C_ov is its mean (routing overlap).
at::Tensor RoutingOverlap(const at::Tensor& probs);

// C_sys = mean_tokens ||pi_tilde(x)||^2.
double SystemConcentration(const at::Tensor& sparse_probs);

// Theorem 1: with pi_hat = pi_tilde normalized per token, r_g = group mass
// of pi_hat and rbar = mean r:
//   lhs = M*||rbar||^2 (= CV_group^2 + 1 of the soft group load sum_x r(x)),
//   rhs = M * S_max * mean ||pi_hat||^2,  and lhs <= rhs.
struct Theorem1Certificate {
  double lhs = 0;
  double rhs = 0;
  std::vector<double> soft_group_load;  // sum_x r(x), length M
};
Theorem1Certificate ComputeTheorem1Certificate(const at::Tensor& sparse_probs,
                                               int64_t num_groups);

// Collision mutual information I_2 = log(N * mean ||pi||^2).
double CollisionMutualInformation(const at::Tensor& probs);

// Group sums of a [T, N] tensor: [T, M].
at::Tensor GroupSums(const at::Tensor& per_expert, int64_t num_groups);

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_ROUTING_ROUTING_MATH_H_
