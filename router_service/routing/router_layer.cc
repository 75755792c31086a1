#include "router_service/routing/router_layer.h"

#include <cmath>
#include <utility>

#include <ATen/ATen.h>
#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "common/weight_init.h"
#include "router_service/routing/routing_math.h"

namespace himoe::router {
namespace {

// The row counts of the segments of `logits` [T, N]: `segments`, or one of
// T rows when empty; an error unless each is >= 1 and they sum to T.
absl::StatusOr<std::vector<int64_t>> CheckedSegments(const RoutingConfig& c,
                                                     const at::Tensor& logits,
                                                     const std::vector<int64_t>& segments) {
  if (logits.dim() != 2 || logits.size(1) != c.num_experts || logits.size(0) < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router: logits must be [T >= 1, N=", c.num_experts, "], got [",
        absl::StrJoin(logits.sizes(), ", "), "]"));
  }
  std::vector<int64_t> bounds = segments;
  if (bounds.empty()) bounds.push_back(logits.size(0));
  int64_t total = 0;
  for (const int64_t n : bounds) {
    if (n < 1) return absl::InvalidArgumentError("router: every segment needs >= 1 row");
    total += n;
  }
  if (total != logits.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat("router: segments sum to ", total,
                                                   " rows, the batch has ", logits.size(0)));
  }
  return bounds;
}

// The state of a fresh router: every statistic zero, the dual variables at
// 0 under a budget (the config's value is their bound), else the config's.
RouterState InitialState(const RoutingConfig& config, const at::TensorOptions& options,
                         uint64_t seed) {
  const auto opts = options.requires_grad(false);
  RouterState s;
  s.logit_ema = at::zeros({config.num_experts}, opts);
  s.loss_free_bias = at::zeros({config.num_experts}, opts);
  s.pending_counts = at::zeros({config.num_experts}, opts);
  s.balance.upper = at::zeros({config.num_experts}, opts);
  s.balance.lower = at::zeros({config.num_experts}, opts);
  s.balance.loss_multiplier = at::zeros({1}, opts);
  s.lambda_intra = at::full({1}, config.epsilon_ov > 0 ? 0.0 : config.lambda_intra, opts);
  s.lambda_inter = at::full({1}, config.epsilon_sys > 0 ? 0.0 : config.lambda_inter, opts);
  s.route_calls = at::zeros({1}, opts.dtype(at::kLong));
  if (config.router_scale && IsGrouped(config.method)) {
    // [1, N] as in the released code, whose optimizer decays every matrix.
    s.router_scale = at::ones({1, config.num_experts}, opts).set_requires_grad(true);
  }
  s.seed = seed;
  return s;
}

}  // namespace

RouterLayer::RouterLayer(const RoutingConfig& config, int64_t d_model, at::Tensor gate,
                         uint64_t seed, bool serving, std::unique_ptr<RoutingStrategy> strategy)
    : config_(config),
      d_model_(d_model),
      gate_weight_(std::move(gate)),
      state_(InitialState(config, gate_weight_.options(), seed)),
      strategy_(std::move(strategy)),
      serving_(serving) {}

at::Tensor RouterLayer::BalanceBias() const { return state_.BalanceBias(); }

absl::StatusOr<std::unique_ptr<RouterLayer>> RouterLayer::Create(
    const RouterLayerOptions& options) {
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<RoutingStrategy> strategy,
                         MakeRoutingStrategy(options.config));
  if (options.d_model < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("router: d_model must be >= 1, got ", options.d_model));
  }
  std::unique_ptr<RouterLayer> layer;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(options.seed);
    at::Tensor gate = at::empty({options.config.num_experts, options.d_model});
    if (options.init == v1::WEIGHT_INIT_SWITCH &&
        options.config.method == RoutingMethod::kLossFree) {
      // The released LossFreeMoERouter's centroids are a bare Parameter its
      // _init_weights never visits: kaiming_uniform_(a = sqrt(5)), i.e.
      // U(-1/sqrt(d), 1/sqrt(d)).
      const double bound = 1.0 / std::sqrt(static_cast<double>(options.d_model));
      gate.uniform_(-bound, bound, gen);
    } else if (options.init == v1::WEIGHT_INIT_SWITCH) {
      SwitchInit_(gate, options.d_model, gen);
    } else {
      gate.normal_(0.0, 0.02, gen);
    }
    gate = gate.to(options.device).set_requires_grad(true);
    layer.reset(new RouterLayer(options.config, options.d_model, std::move(gate),
                                options.seed, options.serving, std::move(strategy)));
    return absl::OkStatus();
  }));
  return layer;
}

absl::StatusOr<RoutingOutput> RouterLayer::Route(const at::Tensor& x, bool training,
                                                 const std::vector<int64_t>& segments) {
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
  return RouteLogits(logits, training, segments);
}

absl::StatusOr<RoutingOutput> RouterLayer::RouteLogits(const at::Tensor& logits, bool training,
                                                       const std::vector<int64_t>& segments) {
  HIMOE_ASSIGN_OR_RETURN(std::vector<int64_t> bounds,
                         CheckedSegments(config_, logits, segments));
  RoutingOutput out;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    out = strategy_->Route(logits, training, serving_, std::move(bounds), state_);
    out.groups = BuildDispatchPlan(out.expert_ids, out.weights, out.kept, config_.num_groups,
                                   config_.experts_per_group());
    return absl::OkStatus();
  }));
  return out;
}

void RouterLayer::ApplyBiasUpdates() { strategy_->ApplyBiasUpdates(state_); }

std::vector<GroupDispatch> BuildDispatchPlan(const at::Tensor& expert_ids,
                                             const at::Tensor& weights,
                                             const at::Tensor& kept,
                                             int64_t num_groups,
                                             int64_t experts_per_group) {
  // A counting sort of the kept slots by expert on the host (stable: within
  // an expert, slots ascend), then one gather of the weights; each group's
  // part is a slice. A few loops over T*K ids, where per-group tensor ops
  // would pay a dispatch per group on every decoding step.
  const int64_t k_total = expert_ids.size(1);
  const int64_t num_experts = num_groups * experts_per_group;
  const at::Tensor ids = expert_ids.detach().to(at::kCPU, at::kLong).contiguous();
  const at::Tensor keep = kept.detach().to(at::kCPU, at::kBool).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const bool* keep_slot = keep.data_ptr<bool>();
  const int64_t n = ids.numel();
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (keep_slot[i] && id[i] >= 0 && id[i] < num_experts) ++start[id[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  const int64_t total = start[num_experts];
  const at::Tensor slots = at::empty({total}, at::kLong);
  const at::Tensor rows = at::empty({total}, at::kLong);
  const at::Tensor sorted_ids = at::empty({total}, at::kLong);
  int64_t* slot = slots.data_ptr<int64_t>();
  int64_t* row = rows.data_ptr<int64_t>();
  int64_t* sorted_id = sorted_ids.data_ptr<int64_t>();
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < n; ++i) {
    if (!keep_slot[i] || id[i] < 0 || id[i] >= num_experts) continue;
    const int64_t pos = next[id[i]]++;
    slot[pos] = i;
    row[pos] = i / k_total;
    sorted_id[pos] = id[i];
  }
  const c10::Device device = expert_ids.device();
  const at::Tensor device_slots = slots.to(device);
  const at::Tensor device_rows = rows.to(device);
  const at::Tensor device_ids = sorted_ids.to(device);
  const at::Tensor sorted_weights = weights.reshape(-1).index_select(0, device_slots);
  std::vector<GroupDispatch> plan(num_groups);
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t begin = start[g * experts_per_group];
    const int64_t count = start[(g + 1) * experts_per_group] - begin;
    GroupDispatch& d = plan[g];
    d.slots = device_slots.narrow(0, begin, count);
    d.token_rows = device_rows.narrow(0, begin, count);
    d.expert_ids = device_ids.narrow(0, begin, count);
    d.weights = sorted_weights.narrow(0, begin, count);
  }
  return plan;
}

}  // namespace himoe::router
