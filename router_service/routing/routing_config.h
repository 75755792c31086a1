#ifndef HIMOE_ROUTER_SERVICE_ROUTING_ROUTING_CONFIG_H_
#define HIMOE_ROUTER_SERVICE_ROUTING_ROUTING_CONFIG_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace himoe::router {

// The five routing methods of shared/spec/routing-math.md ("Selection").
enum class RoutingMethod { kVanilla, kStMoe, kLossFree, kMoge, kHiMoe };

absl::StatusOr<RoutingMethod> ParseRoutingMethod(absl::string_view name);
absl::string_view RoutingMethodName(RoutingMethod method);
// moge and himoe pick top-k inside every group; the others top-K over all N.
bool IsGrouped(RoutingMethod method);

// Which distribution a term reads: the bias-corrected pi (paper) or the raw
// softmax p (released code). For methods without bias correction pi == p.
enum class ProbSource { kCorrected, kRaw };

// R_inter's form: paper = mean ||pi_tilde||^2 over the selected pre-renorm
// weights; released code = mean sum_g (sum_{i in g} p_i)^2 (dense group mass).
enum class InterForm { kSelectedWeights, kDenseGroupMass };

// Expert capacity: paper = ceil(cf*K*T/N); released code = floor(cf*K*T/N),
// rounded up to even (except loss_free), then at least 4.
enum class CapacityRounding { kCeil, kReleased };

// The flat methods' load loss. Paper: h_i = c_i/T, P_i = mean p_i. Released
// code: vanilla takes P_i = sum of the selected (renormalized) weights of
// expert i over T and h_i = c_i/(T*K); st_moe takes h_i from the top-1
// choices only (P_i = mean p_i).
enum class FlatLoadForm { kPaper, kReleased };

struct RoutingConfig {
  int num_experts = 8;  // N
  int num_groups = 4;   // M
  int top_k = 1;        // k per group; flat methods pick K = M*k over all N
  RoutingMethod method = RoutingMethod::kHiMoe;

  double temperature = 1.0;     // T in softmax((g - tau*gbar)/T)
  double tau = 0.01;            // bias-correction strength
  double ema_beta = 0.9;        // beta of the logit EMA
  double lambda_intra = 0.1;    // R_intra weight
  double lambda_inter = 0.05;   // R_inter weight
  double alpha = 0.01;          // GShard load-loss weight
  double z_coef = 0.001;        // c_z of the ST-MoE z-loss
  double capacity_factor = 0.0; // 0 = dropless
  double loss_free_rate = 0.001;  // u of the loss_free bias update

  // Paper/released-code switches (see the spec's last table).
  bool renormalize = false;
  InterForm inter_form = InterForm::kSelectedWeights;
  ProbSource intra_source = ProbSource::kCorrected;
  ProbSource load_source = ProbSource::kCorrected;
  CapacityRounding capacity_rounding = CapacityRounding::kCeil;
  FlatLoadForm flat_load = FlatLoadForm::kPaper;
  // The z-loss on vanilla, moge and himoe too, as their released configs
  // set it (st_moe always has it; loss_free never).
  bool released_z_loss = false;
  // A learnable per-expert scale (init 1) multiplies each selected expert's
  // combine weight after renormalization; moge and himoe only.
  bool router_scale = false;
  // st_moe: a pick of rank >= 1 is kept with probability
  // min(1, weight / threshold) (renormalized weight); 0 = keep every pick.
  double second_choice_threshold = 0.0;
  // loss_free: scores are sigmoid(g) instead of softmax, and the bias update
  // uses the counts of the last micro-batch only.
  bool sigmoid_scores = false;

  // Balance controller (not in the paper): holds every expert's load within
  // [1 - delta, 1 + delta] of the mean, delta = kBalanceBand * target, by
  // projected dual ascent on per-expert selection biases, run on each
  // training batch (RouterLayer::balance, BalanceControllerUpdate); then
  // expert CV <= delta < target. 0 = off; not with loss_free, which has its
  // own bias.
  double target_expert_cv = 0.0;
  double balance_rate = 0.1;  // the dual ascent's largest step, in logits per unit violation

  // Dual ascent on the paper's own constraints (Sec. "Hi-MoE objective"):
  // C_ov <= epsilon_ov with multiplier lambda_intra, C_sys <= epsilon_sys
  // with lambda_inter, each starting at 0, moved on every training batch by
  // DualAscentStep (rate dual_rate) and bounded by the value above. 0 = off:
  // the fixed lambda of the paper's experiments. himoe only.
  double epsilon_ov = 0.0;
  double epsilon_sys = 0.0;
  double dual_rate = 0.01;

  int experts_per_group() const { return num_experts / num_groups; }  // S
  int total_k() const { return num_groups * top_k; }                  // K
};

// The share of the target CV the controller's band uses; the rest is margin
// for batch-to-batch noise of the counts.
inline constexpr double kBalanceBand = 0.75;
// The dual-ascent step of the controller's loss multiplier, per unit of CV
// above the target and per training batch.
inline constexpr double kBalanceLossRate = 0.01;

// The product default of target_expert_cv for a method: 0.1 for himoe (whose
// objective collapses inside groups without it; docs/research/balance.md),
// 0 (off) for the others.
double DefaultTargetExpertCv(RoutingMethod method);
// The product defaults of the budgets (from the study in
// docs/research/balance.md): epsilon_ov 0.8 (mean ||pi||^2 >= 0.2, a little
// more decisive than an untrained gate) and epsilon_sys 0.3 for himoe; 0
// (off, fixed lambdas) for the others.
double DefaultEpsilonOv(RoutingMethod method);
double DefaultEpsilonSys(RoutingMethod method);

// Sets every paper/released-code switch at once. `preset` is "paper" (the
// paper's formulas, dropless) or "reference" (the authors' released code:
// every row of the spec's last table: renormalized weights, dense-group-mass
// R_inter, raw-p R_intra and load loss, capacity factor 2.0 with its
// rounding, z-loss on the grouped methods, the router scale, the released
// flat load losses, st_moe's random second-choice drop at 0.2, loss_free's
// sigmoid scores).
absl::Status ApplyPreset(absl::string_view preset, RoutingConfig* config);

// Rejects inconsistent configs with a message that names the field.
absl::Status ValidateRoutingConfig(const RoutingConfig& config);

std::string RoutingConfigDebugString(const RoutingConfig& config);

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_ROUTING_ROUTING_CONFIG_H_
