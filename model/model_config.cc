#include "model/model_config.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace himoe::model {
namespace {

constexpr char kSelectedWeights[] = "selected_weights";
constexpr char kDenseGroupMass[] = "dense_group_mass";
constexpr char kCorrected[] = "corrected";
constexpr char kRaw[] = "raw";

std::string InterFormName(router::InterForm form) {
  return form == router::InterForm::kSelectedWeights ? kSelectedWeights : kDenseGroupMass;
}

std::string ProbSourceName(router::ProbSource source) {
  return source == router::ProbSource::kCorrected ? kCorrected : kRaw;
}

absl::StatusOr<router::InterForm> ParseInterForm(absl::string_view name) {
  if (name == kSelectedWeights) return router::InterForm::kSelectedWeights;
  if (name == kDenseGroupMass) return router::InterForm::kDenseGroupMass;
  return absl::InvalidArgumentError(absl::StrCat("routing: inter_form '", name,
                                                 "' is unknown; expected ", kSelectedWeights,
                                                 " or ", kDenseGroupMass));
}

absl::StatusOr<router::ProbSource> ParseProbSource(absl::string_view field,
                                                   absl::string_view name) {
  if (name == kCorrected) return router::ProbSource::kCorrected;
  if (name == kRaw) return router::ProbSource::kRaw;
  return absl::InvalidArgumentError(absl::StrCat("routing: ", field, " '", name,
                                                 "' is unknown; expected ", kCorrected,
                                                 " or ", kRaw));
}

constexpr char kCeil[] = "ceil";
constexpr char kReleased[] = "released";
constexpr char kPaper[] = "paper";

// `name` of an enum with two values; empty reads as the first (fields added
// after checkpoints were written).
template <typename Enum>
absl::StatusOr<Enum> ParseTwoWay(absl::string_view field, absl::string_view name,
                                 const char* first, Enum first_value, const char* second,
                                 Enum second_value) {
  if (name.empty() || name == first) return first_value;
  if (name == second) return second_value;
  return absl::InvalidArgumentError(absl::StrCat("routing: ", field, " '", name,
                                                 "' is unknown; expected ", first, " or ",
                                                 second));
}

}  // namespace

int MoeIndex(const ModelOptions& o, int layer) {
  if (o.moe_every == 1) return layer;
  return layer % 2 == 1 ? layer / 2 : -1;
}

int NumMoeLayers(const ModelOptions& o) {
  int n = 0;
  for (int i = 0; i < o.n_layer; ++i) n += MoeIndex(o, i) >= 0;
  return n;
}

absl::Status ValidateModelOptions(const ModelOptions& o) {
  HIMOE_RETURN_IF_ERROR(router::ValidateRoutingConfig(o.routing));
  if (o.vocab_size < 2 || o.block_size < 1 || o.n_layer < 1 || o.n_head < 1 ||
      o.d_model % o.n_head != 0 || o.d_ff < 1 || o.dense_ff < 1 ||
      (o.moe_every != 1 && o.moe_every != 2)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: need vocab_size >= 2, block_size >= 1, n_layer >= 1, d_model divisible by "
        "n_head, d_ff, dense_ff >= 1, moe_every 1 or 2; got vocab ", o.vocab_size,
        ", block ", o.block_size, ", layers ", o.n_layer, ", d_model ", o.d_model, ", heads ",
        o.n_head, ", moe_every ", o.moe_every));
  }
  if (NumMoeLayers(o) < 1) return absl::InvalidArgumentError("model: no MoE layer");
  if (o.expert_dtype != v1::DTYPE_FLOAT32 && o.expert_dtype != v1::DTYPE_BFLOAT16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: expert_dtype must be float32 or bfloat16, got ", v1::DType_Name(o.expert_dtype)));
  }
  if (o.matmul_dtype != v1::DTYPE_FLOAT32 && o.matmul_dtype != v1::DTYPE_BFLOAT16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: matmul_dtype must be float32 or bfloat16, got ", v1::DType_Name(o.matmul_dtype)));
  }
  if (!v1::WeightInit_IsValid(o.init)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: init must be default or switch, got ", o.init));
  }
  return absl::OkStatus();
}

double TrainingFlopsPerToken(const ModelOptions& o) {
  const double d = static_cast<double>(o.d_model);
  double macs = d * static_cast<double>(o.vocab_size);
  for (int layer = 0; layer < o.n_layer; ++layer) {
    macs += 4 * d * d + 2 * static_cast<double>(o.block_size) * d;
    if (MoeIndex(o, layer) >= 0) {
      macs += d * o.routing.num_experts +
              o.routing.total_k() * 2 * d * static_cast<double>(o.d_ff);
    } else {
      macs += 2 * d * static_cast<double>(o.dense_ff);
    }
  }
  return 6 * macs;
}

v1::WeightInit InitForPreset(absl::string_view preset) {
  return preset == "reference" ? v1::WEIGHT_INIT_SWITCH : v1::WEIGHT_INIT_DEFAULT;
}

v1::ExpertShape ExpertShapeFor(const ModelOptions& o) {
  v1::ExpertShape s;
  s.set_num_experts(o.routing.num_experts);
  s.set_num_groups(o.routing.num_groups);
  s.set_num_layers(NumMoeLayers(o));
  s.set_d_model(o.d_model);
  s.set_d_ff(o.d_ff);
  s.set_seed(o.seed);
  s.set_dtype(o.expert_dtype);
  if (o.matmul_dtype == v1::DTYPE_BFLOAT16) s.set_matmul_dtype(o.matmul_dtype);
  if (o.init != v1::WEIGHT_INIT_DEFAULT) {
    s.set_init(o.init);
    s.set_n_layer(o.n_layer);
  }
  return s;
}

v1::RoutingSettings RoutingSettingsToProto(const router::RoutingConfig& c) {
  v1::RoutingSettings s;
  s.set_method(std::string(router::RoutingMethodName(c.method)));
  s.set_num_experts(c.num_experts);
  s.set_num_groups(c.num_groups);
  s.set_top_k(c.top_k);
  s.set_temperature(c.temperature);
  s.set_tau(c.tau);
  s.set_ema_beta(c.ema_beta);
  s.set_lambda_intra(c.lambda_intra);
  s.set_lambda_inter(c.lambda_inter);
  s.set_alpha(c.alpha);
  s.set_z_coef(c.z_coef);
  s.set_capacity_factor(c.capacity_factor);
  s.set_loss_free_rate(c.loss_free_rate);
  s.set_renormalize(c.renormalize);
  s.set_inter_form(InterFormName(c.inter_form));
  s.set_intra_source(ProbSourceName(c.intra_source));
  s.set_load_source(ProbSourceName(c.load_source));
  s.set_capacity_rounding(c.capacity_rounding == router::CapacityRounding::kCeil ? kCeil
                                                                                 : kReleased);
  s.set_flat_load(c.flat_load == router::FlatLoadForm::kPaper ? kPaper : kReleased);
  s.set_released_z_loss(c.released_z_loss);
  s.set_router_scale(c.router_scale);
  s.set_second_choice_threshold(c.second_choice_threshold);
  s.set_sigmoid_scores(c.sigmoid_scores);
  s.set_target_expert_cv(c.target_expert_cv);
  s.set_balance_rate(c.balance_rate);
  s.set_epsilon_ov(c.epsilon_ov);
  s.set_epsilon_sys(c.epsilon_sys);
  s.set_dual_rate(c.dual_rate);
  return s;
}

absl::StatusOr<router::RoutingConfig> RoutingConfigFromProto(const v1::RoutingSettings& s) {
  router::RoutingConfig c;
  HIMOE_ASSIGN_OR_RETURN(c.method, router::ParseRoutingMethod(s.method()));
  c.num_experts = s.num_experts();
  c.num_groups = s.num_groups();
  c.top_k = s.top_k();
  c.temperature = s.temperature();
  c.tau = s.tau();
  c.ema_beta = s.ema_beta();
  c.lambda_intra = s.lambda_intra();
  c.lambda_inter = s.lambda_inter();
  c.alpha = s.alpha();
  c.z_coef = s.z_coef();
  c.capacity_factor = s.capacity_factor();
  c.loss_free_rate = s.loss_free_rate();
  c.renormalize = s.renormalize();
  HIMOE_ASSIGN_OR_RETURN(c.inter_form, ParseInterForm(s.inter_form()));
  HIMOE_ASSIGN_OR_RETURN(c.intra_source, ParseProbSource("intra_source", s.intra_source()));
  HIMOE_ASSIGN_OR_RETURN(c.load_source, ParseProbSource("load_source", s.load_source()));
  HIMOE_ASSIGN_OR_RETURN(c.capacity_rounding,
                         ParseTwoWay("capacity_rounding", s.capacity_rounding(), kCeil,
                                     router::CapacityRounding::kCeil, kReleased,
                                     router::CapacityRounding::kReleased));
  HIMOE_ASSIGN_OR_RETURN(c.flat_load,
                         ParseTwoWay("flat_load", s.flat_load(), kPaper,
                                     router::FlatLoadForm::kPaper, kReleased,
                                     router::FlatLoadForm::kReleased));
  c.released_z_loss = s.released_z_loss();
  c.router_scale = s.router_scale();
  c.second_choice_threshold = s.second_choice_threshold();
  c.sigmoid_scores = s.sigmoid_scores();
  c.target_expert_cv = s.target_expert_cv();
  c.balance_rate = s.balance_rate();
  c.epsilon_ov = s.epsilon_ov();
  c.epsilon_sys = s.epsilon_sys();
  c.dual_rate = s.dual_rate();
  HIMOE_RETURN_IF_ERROR(router::ValidateRoutingConfig(c));
  return c;
}

v1::ModelConfig ModelConfigToProto(const ModelOptions& o) {
  v1::ModelConfig m;
  m.set_vocab_size(o.vocab_size);
  m.set_block_size(o.block_size);
  m.set_n_layer(o.n_layer);
  m.set_n_head(o.n_head);
  m.set_d_model(o.d_model);
  m.set_d_ff(o.d_ff);
  m.set_dense_ff(o.dense_ff);
  m.set_moe_every(o.moe_every);
  m.set_seed(o.seed);
  *m.mutable_routing() = RoutingSettingsToProto(o.routing);
  m.set_expert_dtype(o.expert_dtype);
  m.set_init(o.init);
  return m;
}

absl::StatusOr<ModelOptions> ModelOptionsFromProto(const v1::ModelConfig& m) {
  ModelOptions o;
  o.vocab_size = m.vocab_size();
  o.block_size = m.block_size();
  o.n_layer = m.n_layer();
  o.n_head = m.n_head();
  o.d_model = m.d_model();
  o.d_ff = m.d_ff();
  o.dense_ff = m.dense_ff();
  o.moe_every = m.moe_every();
  o.seed = m.seed();
  HIMOE_ASSIGN_OR_RETURN(o.routing, RoutingConfigFromProto(m.routing()));
  o.expert_dtype =
      m.expert_dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_FLOAT32 : m.expert_dtype();
  o.init = m.init();
  return o;
}

absl::StatusOr<router::RoutingConfig> RoutingConfigFromCluster(const v1::ClusterConfig& cluster) {
  router::RoutingConfig c;
  const v1::ModelSpec& m = cluster.model();
  const v1::RoutingSpec& r = cluster.routing();
  c.num_experts = m.num_experts();
  c.num_groups = m.num_groups();
  c.top_k = m.top_k();
  HIMOE_ASSIGN_OR_RETURN(c.method,
                         router::ParseRoutingMethod(r.method().empty() ? "himoe" : r.method()));
  HIMOE_RETURN_IF_ERROR(router::ApplyPreset(r.preset().empty() ? "paper" : r.preset(), &c));
  if (r.has_temperature()) c.temperature = r.temperature();
  if (r.has_tau()) c.tau = r.tau();
  if (r.has_ema_beta()) c.ema_beta = r.ema_beta();
  if (r.has_lambda_intra()) c.lambda_intra = r.lambda_intra();
  if (r.has_lambda_inter()) c.lambda_inter = r.lambda_inter();
  if (r.has_alpha()) c.alpha = r.alpha();
  if (r.has_z_coef()) c.z_coef = r.z_coef();
  if (r.has_capacity_factor()) c.capacity_factor = r.capacity_factor();
  if (r.has_renormalize()) c.renormalize = r.renormalize();
  c.target_expert_cv = r.has_target_expert_cv() ? r.target_expert_cv()
                                                : router::DefaultTargetExpertCv(c.method);
  if (r.has_balance_rate()) c.balance_rate = r.balance_rate();
  c.epsilon_ov = r.has_epsilon_ov() ? r.epsilon_ov() : router::DefaultEpsilonOv(c.method);
  c.epsilon_sys = r.has_epsilon_sys() ? r.epsilon_sys() : router::DefaultEpsilonSys(c.method);
  if (r.has_dual_rate()) c.dual_rate = r.dual_rate();
  HIMOE_RETURN_IF_ERROR(router::ValidateRoutingConfig(c));
  return c;
}

}  // namespace himoe::model
