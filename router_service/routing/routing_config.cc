#include "router_service/routing/routing_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace himoe::router {
namespace {

constexpr struct {
  RoutingMethod method;
  absl::string_view name;
} kMethods[] = {
    {RoutingMethod::kVanilla, "vanilla"}, {RoutingMethod::kStMoe, "st_moe"},
    {RoutingMethod::kLossFree, "loss_free"}, {RoutingMethod::kMoge, "moge"},
    {RoutingMethod::kHiMoe, "himoe"},
};

absl::Status Invalid(absl::string_view field, absl::string_view expected,
                     double got) {
  return absl::InvalidArgumentError(
      absl::StrFormat("routing config: %s must be %s, got %g", field, expected, got));
}

}  // namespace

absl::StatusOr<RoutingMethod> ParseRoutingMethod(absl::string_view name) {
  for (const auto& m : kMethods) {
    if (m.name == name) return m.method;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "routing config: method '", name,
      "' is unknown; expected vanilla, st_moe, loss_free, moge or himoe"));
}

absl::string_view RoutingMethodName(RoutingMethod method) {
  for (const auto& m : kMethods) {
    if (m.method == method) return m.name;
  }
  return "unknown";
}

bool IsGrouped(RoutingMethod method) {
  return method == RoutingMethod::kMoge || method == RoutingMethod::kHiMoe;
}

double DefaultTargetExpertCv(RoutingMethod method) {
  return method == RoutingMethod::kHiMoe ? 0.1 : 0.0;
}

double DefaultEpsilonOv(RoutingMethod method) {
  return method == RoutingMethod::kHiMoe ? 0.8 : 0.0;
}

double DefaultEpsilonSys(RoutingMethod method) {
  return method == RoutingMethod::kHiMoe ? 0.3 : 0.0;
}

absl::Status ApplyPreset(absl::string_view preset, RoutingConfig* config) {
  const bool reference = preset == "reference";
  if (!reference && preset != "paper") {
    return absl::InvalidArgumentError(absl::StrCat(
        "routing config: preset '", preset, "' is unknown; expected paper or reference"));
  }
  config->renormalize = reference;
  config->inter_form =
      reference ? InterForm::kDenseGroupMass : InterForm::kSelectedWeights;
  config->intra_source = reference ? ProbSource::kRaw : ProbSource::kCorrected;
  config->load_source = reference ? ProbSource::kRaw : ProbSource::kCorrected;
  config->capacity_factor = reference ? 2.0 : 0.0;
  config->capacity_rounding =
      reference ? CapacityRounding::kReleased : CapacityRounding::kCeil;
  config->flat_load = reference ? FlatLoadForm::kReleased : FlatLoadForm::kPaper;
  config->released_z_loss = reference;
  config->router_scale = reference;
  config->second_choice_threshold = reference ? 0.2 : 0.0;
  config->sigmoid_scores = reference;
  return absl::OkStatus();
}

absl::Status ValidateRoutingConfig(const RoutingConfig& c) {
  if (c.num_experts < 1) return Invalid("num_experts (N)", ">= 1", c.num_experts);
  if (c.num_groups < 1) return Invalid("num_groups (M)", ">= 1", c.num_groups);
  if (c.num_experts % c.num_groups != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "routing config: num_experts (N=%d) must be divisible by num_groups (M=%d)",
        c.num_experts, c.num_groups));
  }
  if (c.top_k < 1 || c.top_k > c.experts_per_group()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "routing config: top_k (k=%d) must be in [1, N/M=%d]", c.top_k,
        c.experts_per_group()));
  }
  struct Check {
    absl::string_view field;
    double value;
    bool ok;
    absl::string_view expected;
  };
  const Check checks[] = {
      {"temperature (T)", c.temperature, c.temperature > 0, "> 0"},
      {"tau", c.tau, c.tau >= 0, ">= 0"},
      {"ema_beta (beta)", c.ema_beta, c.ema_beta >= 0 && c.ema_beta < 1, "in [0, 1)"},
      {"lambda_intra", c.lambda_intra, c.lambda_intra >= 0, ">= 0"},
      {"lambda_inter", c.lambda_inter, c.lambda_inter >= 0, ">= 0"},
      {"alpha", c.alpha, c.alpha >= 0, ">= 0"},
      {"z_coef (c_z)", c.z_coef, c.z_coef >= 0, ">= 0"},
      {"capacity_factor", c.capacity_factor, c.capacity_factor >= 0,
       ">= 0 (0 = dropless)"},
      {"loss_free_rate (u)", c.loss_free_rate, c.loss_free_rate >= 0, ">= 0"},
      {"second_choice_threshold", c.second_choice_threshold,
       c.second_choice_threshold >= 0, ">= 0 (0 = keep every pick)"},
      {"target_expert_cv", c.target_expert_cv, c.target_expert_cv >= 0, ">= 0 (0 = off)"},
      {"balance_rate (eta)", c.balance_rate, c.balance_rate >= 0, ">= 0"},
      {"epsilon_ov", c.epsilon_ov, c.epsilon_ov >= 0 && c.epsilon_ov < 1,
       "in [0, 1) (0 = fixed lambda_intra)"},
      {"epsilon_sys", c.epsilon_sys, c.epsilon_sys >= 0 && c.epsilon_sys <= 1,
       "in [0, 1] (0 = fixed lambda_inter)"},
      {"dual_rate", c.dual_rate, c.dual_rate >= 0, ">= 0"},
  };
  for (const Check& check : checks) {
    if (!std::isfinite(check.value) || !check.ok) {
      return Invalid(check.field, check.expected, check.value);
    }
  }
  if (c.target_expert_cv > 0 && c.method == RoutingMethod::kLossFree) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "routing config: target_expert_cv must be 0 for loss_free (it balances "
        "with its own bias), got %g",
        c.target_expert_cv));
  }
  if ((c.epsilon_ov > 0 || c.epsilon_sys > 0) && c.method != RoutingMethod::kHiMoe) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "routing config: epsilon_ov and epsilon_sys must be 0 for %s (only himoe has "
        "R_intra and R_inter), got %g and %g",
        RoutingMethodName(c.method), c.epsilon_ov, c.epsilon_sys));
  }
  return absl::OkStatus();
}

std::string RoutingConfigDebugString(const RoutingConfig& c) {
  return absl::StrFormat(
      "method=%s N=%d M=%d k=%d T=%g tau=%g beta=%g lambda_intra=%g "
      "lambda_inter=%g alpha=%g c_z=%g capacity_factor=%g renormalize=%d "
      "inter=%s intra=%s load=%s capacity_rounding=%s flat_load=%s "
      "released_z_loss=%d router_scale=%d second_choice_threshold=%g "
      "sigmoid_scores=%d target_expert_cv=%g balance_rate=%g epsilon_ov=%g "
      "epsilon_sys=%g dual_rate=%g",
      RoutingMethodName(c.method), c.num_experts, c.num_groups, c.top_k,
      c.temperature, c.tau, c.ema_beta, c.lambda_intra, c.lambda_inter,
      c.alpha, c.z_coef, c.capacity_factor, c.renormalize,
      c.inter_form == InterForm::kSelectedWeights ? "selected" : "dense_group_mass",
      c.intra_source == ProbSource::kCorrected ? "pi" : "p",
      c.load_source == ProbSource::kCorrected ? "pi" : "p",
      c.capacity_rounding == CapacityRounding::kCeil ? "ceil" : "released",
      c.flat_load == FlatLoadForm::kPaper ? "paper" : "released", c.released_z_loss,
      c.router_scale, c.second_choice_threshold, c.sigmoid_scores, c.target_expert_cv,
      c.balance_rate, c.epsilon_ov, c.epsilon_sys, c.dual_rate);
}

}  // namespace himoe::router
