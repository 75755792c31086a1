#ifndef HIMOE_ROUTER_SERVICE_ROUTING_CONFIG_H_
#define HIMOE_ROUTER_SERVICE_ROUTING_CONFIG_H_

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

  int experts_per_group() const { return num_experts / num_groups; }  // S
  int total_k() const { return num_groups * top_k; }                  // K
};

// Sets every paper/released-code switch at once. `preset` is "paper" (the
// paper's formulas, dropless) or "reference" (the authors' released code:
// renormalized weights, dense-group-mass R_inter, raw-p R_intra and load
// loss, capacity factor 2.0).
absl::Status ApplyPreset(absl::string_view preset, RoutingConfig* config);

// Rejects inconsistent configs with a message that names the field.
absl::Status ValidateRoutingConfig(const RoutingConfig& config);

std::string RoutingConfigDebugString(const RoutingConfig& config);

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_ROUTING_CONFIG_H_
