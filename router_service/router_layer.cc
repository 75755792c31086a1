#include "router_service/router_layer.h"

#include <utility>

#include <ATen/ATen.h>
#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "router_service/routing_math.h"

namespace himoe::router {
namespace {

std::vector<double> ToVector(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

RoutingStats ComputeStats(const RoutingConfig& c, const at::Tensor& probs,
                          const at::Tensor& sparse, const at::Tensor& ids,
                          const at::Tensor& kept, int64_t capacity) {
  at::NoGradGuard no_grad;
  RoutingStats s;
  s.tokens = ids.size(0);
  const at::Tensor counts = at::bincount(ids.reshape(-1), {}, c.num_experts);
  s.expert_counts = ToVector(counts);
  s.group_counts = ToVector(counts.view({c.num_groups, -1}).sum(1));
  s.soft_group_load = ToVector(GroupSums(probs.detach(), c.num_groups).sum(0));
  s.expert_cv = CoefficientOfVariation(s.expert_counts);
  s.group_cv = CoefficientOfVariation(s.group_counts);
  s.max_vio = MaxViolation(s.expert_counts);
  s.groups_per_token = GroupsPerToken(ids, c.experts_per_group(), c.num_groups);
  s.c_ov = RoutingOverlap(probs.detach()).mean().item<double>();
  s.c_sys = SystemConcentration(sparse);
  const Theorem1Certificate cert = ComputeTheorem1Certificate(sparse, c.num_groups);
  s.cert_lhs = cert.lhs;
  s.cert_rhs = cert.rhs;
  s.collision_mi = CollisionMutualInformation(probs);
  s.capacity = capacity;
  s.dropped = kept.numel() - kept.sum().item<int64_t>();
  s.drop_rate = kept.numel() == 0 ? 0.0
                                  : static_cast<double>(s.dropped) / kept.numel();
  return s;
}

}  // namespace

RouterLayer::RouterLayer(const RoutingConfig& config, int64_t d_model,
                         at::Tensor gate)
    : config_(config), d_model_(d_model), gate_weight_(std::move(gate)) {
  const auto opts = gate_weight_.options().requires_grad(false);
  logit_ema_ = at::zeros({config_.num_experts}, opts);
  loss_free_bias_ = at::zeros({config_.num_experts}, opts);
  pending_counts_ = at::zeros({config_.num_experts}, opts);
}

absl::StatusOr<std::unique_ptr<RouterLayer>> RouterLayer::Create(
    const RouterLayerOptions& options) {
  HIMOE_RETURN_IF_ERROR(ValidateRoutingConfig(options.config));
  if (options.d_model < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("router: d_model must be >= 1, got ", options.d_model));
  }
  std::unique_ptr<RouterLayer> layer;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(options.seed);
    // nanoGPT-style N(0, 0.02) init.
    at::Tensor gate = at::normal(0.0, 0.02, {options.config.num_experts, options.d_model},
                                 gen, at::dtype(at::kFloat))
                          .to(options.device)
                          .set_requires_grad(true);
    layer.reset(new RouterLayer(options.config, options.d_model, std::move(gate)));
    return absl::OkStatus();
  }));
  return layer;
}

absl::StatusOr<RoutingOutput> RouterLayer::Route(const at::Tensor& x,
                                                 bool training) {
  if (x.dim() != 2 || x.size(1) != d_model_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router: input must be [T, d_model=", d_model_, "], got [",
        absl::StrJoin(x.sizes(), ", "), "]"));
  }
  at::Tensor logits;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    logits = RouterLogits(x, gate_weight_);
    return absl::OkStatus();
  }));
  return RouteLogits(logits, training);
}

absl::StatusOr<RoutingOutput> RouterLayer::RouteLogits(const at::Tensor& logits,
                                                       bool training) {
  const RoutingConfig& c = config_;
  if (logits.dim() != 2 || logits.size(1) != c.num_experts || logits.size(0) < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router: logits must be [T >= 1, N=", c.num_experts, "], got [",
        absl::StrJoin(logits.sizes(), ", "), "]"));
  }
  RoutingOutput out;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    // fp32 at least; double input stays double (used by gradient checks).
    const at::Tensor g =
        logits.scalar_type() == at::kDouble ? logits : logits.to(at::kFloat);
    const int64_t tokens = g.size(0);
    const at::Tensor p = at::softmax(g, -1);
    // pi: the bias-corrected distribution for himoe, p for every other method.
    at::Tensor pi = p;
    if (c.method == RoutingMethod::kHiMoe) {
      if (training) UpdateLogitEma(logit_ema_, g, c.ema_beta);
      pi = CorrectedProbs(g, logit_ema_, c.tau, c.temperature);
    }

    Selection sel;
    if (IsGrouped(c.method)) {
      sel = SelectGroupedTopK(pi, c.num_groups, c.top_k);
    } else if (c.method == RoutingMethod::kLossFree) {
      sel = SelectFlatTopK(p + loss_free_bias_, c.total_k());
    } else {
      sel = SelectFlatTopK(p, c.total_k());
    }
    const at::Tensor sparse = SparseSelectedProbs(pi, sel.ids);
    at::Tensor weights = pi.gather(1, sel.ids);
    if (c.renormalize) weights = RenormalizeWeights(weights);
    const int64_t capacity =
        ExpertCapacity(c.capacity_factor, c.total_k(), tokens, c.num_experts);
    const at::Tensor kept = CapacityKeepMask(sel, c.num_experts, capacity);

    const at::Tensor zero = at::zeros({}, g.options().requires_grad(false));
    RoutingLosses& losses = out.losses;
    losses.load = losses.intra = losses.inter = losses.z = zero;
    const at::Tensor& load_probs = c.load_source == ProbSource::kCorrected ? pi : p;
    if (c.method != RoutingMethod::kLossFree) {
      losses.load = LoadBalancingLoss(load_probs, sel.ids, c.alpha);
    }
    if (c.method == RoutingMethod::kHiMoe) {
      losses.intra = IntraGroupRegularizer(
          c.intra_source == ProbSource::kCorrected ? pi : p, c.lambda_intra);
      losses.inter = c.inter_form == InterForm::kSelectedWeights
                         ? InterGroupRegularizer(sparse, c.lambda_inter)
                         : InterGroupRegularizerDenseGroupMass(p, c.num_groups,
                                                               c.lambda_inter);
    }
    if (c.method == RoutingMethod::kStMoe) losses.z = RouterZLoss(g, c.z_coef);

    if (training && c.method == RoutingMethod::kLossFree) {
      at::NoGradGuard no_grad;
      pending_counts_.add_(
          at::bincount(sel.ids.reshape(-1), {}, c.num_experts).to(pending_counts_.options()));
    }
    out.stats = ComputeStats(c, pi, sparse, sel.ids, kept, capacity);
    out.groups = BuildDispatchPlan(sel.ids, weights, kept, c.num_groups,
                                   c.experts_per_group());
    out.expert_ids = sel.ids;
    out.weights = weights;
    out.kept = kept;
    out.probs = pi;
    return absl::OkStatus();
  }));
  return out;
}

void RouterLayer::ApplyLossFreeBiasUpdate() {
  if (config_.method != RoutingMethod::kLossFree) return;
  LossFreeBiasUpdate(loss_free_bias_, pending_counts_, config_.loss_free_rate);
  pending_counts_.zero_();
}

std::vector<GroupDispatch> BuildDispatchPlan(const at::Tensor& expert_ids,
                                             const at::Tensor& weights,
                                             const at::Tensor& kept,
                                             int64_t num_groups,
                                             int64_t experts_per_group) {
  const int64_t k_total = expert_ids.size(1);
  const at::Tensor flat_ids = expert_ids.reshape(-1);
  const at::Tensor flat_w = weights.reshape(-1);
  const at::Tensor flat_kept = kept.reshape(-1);
  const at::Tensor group_of = at::div(flat_ids, experts_per_group, "floor");
  std::vector<GroupDispatch> plan(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    at::Tensor slots = at::nonzero(flat_kept & group_of.eq(g)).reshape(-1);
    const at::Tensor ids = flat_ids.index_select(0, slots);
    const at::Tensor order =
        std::get<1>(at::sort(ids, /*stable=*/true, /*dim=*/0, /*descending=*/false));
    slots = slots.index_select(0, order);
    GroupDispatch& d = plan[g];
    d.slots = slots;
    d.token_rows = at::div(slots, k_total, "floor");
    d.expert_ids = flat_ids.index_select(0, slots);
    d.weights = flat_w.index_select(0, slots);
  }
  return plan;
}

at::Tensor CombineGroupOutputs(int64_t num_tokens, int64_t d_model,
                               const std::vector<GroupDispatch>& groups,
                               const std::vector<at::Tensor>& outputs) {
  const auto device = groups.empty() ? at::Device(at::kCPU)
                                     : groups.front().token_rows.device();
  at::Tensor out = at::zeros({num_tokens, d_model}, at::dtype(at::kFloat).device(device));
  for (size_t g = 0; g < groups.size(); ++g) {
    if (groups[g].token_rows.numel() == 0) continue;
    const at::Tensor y = outputs[g].to(device, at::kFloat);
    out = out.index_add(0, groups[g].token_rows, y * groups[g].weights.unsqueeze(1));
  }
  return out;
}

}  // namespace himoe::router
