#include "router_service/routing/router_layer.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <ATen/ATen.h>
#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/profile_scope.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "common/weight_init.h"
#include "router_service/routing/routing_math.h"

namespace himoe::router {
namespace {

std::vector<double> ToVector(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

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

// The statistics that need only the picks: what the serving metrics read.
RoutingStats CountStats(const RoutingConfig& c, const at::Tensor& ids, const at::Tensor& kept,
                        int64_t capacity) {
  at::NoGradGuard no_grad;
  RoutingStats s;
  s.tokens = ids.size(0);
  const at::Tensor counts = at::bincount(ids.reshape(-1), {}, c.num_experts);
  s.expert_counts = ToVector(counts);
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
  s.soft_group_load = ToVector(GroupSums(probs.detach(), c.num_groups).sum(0));
  s.mean_pi_sq = probs.detach().pow(2).sum(1).mean().item<double>();
  s.c_ov = 1.0 - s.mean_pi_sq;  // mean of RoutingOverlap
  s.c_sys = SystemConcentration(sparse);
  const Theorem1Certificate cert = ComputeTheorem1Certificate(sparse, c.num_groups);
  s.cert_lhs = cert.lhs;
  s.cert_rhs = cert.rhs;
  s.collision_mi = CollisionMutualInformation(probs);
  s.balance_bias = ToVector(bias);
  return s;
}

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

RoutingStats MergeRoutingStats(const RoutingConfig& c,
                               const std::vector<RoutingStats>& batches) {
  RoutingStats s;
  s.expert_counts.assign(c.num_experts, 0.0);
  s.group_counts.assign(c.num_groups, 0.0);
  s.soft_group_load.assign(c.num_groups, 0.0);
  int64_t assignments = 0;
  for (const RoutingStats& b : batches) s.tokens += b.tokens;
  for (const RoutingStats& b : batches) {
    for (int i = 0; i < c.num_experts && i < static_cast<int>(b.expert_counts.size()); ++i) {
      s.expert_counts[i] += b.expert_counts[i];
    }
    for (int g = 0; g < c.num_groups && g < static_cast<int>(b.group_counts.size()); ++g) {
      s.group_counts[g] += b.group_counts[g];
      if (g < static_cast<int>(b.soft_group_load.size())) s.soft_group_load[g] += b.soft_group_load[g];
    }
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

RouterLayer::RouterLayer(const RoutingConfig& config, int64_t d_model, at::Tensor gate,
                         uint64_t seed, bool serving)
    : config_(config),
      d_model_(d_model),
      gate_weight_(std::move(gate)),
      seed_(seed),
      serving_(serving) {
  const auto opts = gate_weight_.options().requires_grad(false);
  logit_ema_ = at::zeros({config_.num_experts}, opts);
  loss_free_bias_ = at::zeros({config_.num_experts}, opts);
  pending_counts_ = at::zeros({config_.num_experts}, opts);
  balance_.upper = at::zeros({config_.num_experts}, opts);
  balance_.lower = at::zeros({config_.num_experts}, opts);
  balance_.loss_multiplier = at::zeros({1}, opts);
  // Dual variables start at 0, the config's value is their upper bound.
  lambda_intra_ = at::full({1}, config_.epsilon_ov > 0 ? 0.0 : config_.lambda_intra, opts);
  lambda_inter_ = at::full({1}, config_.epsilon_sys > 0 ? 0.0 : config_.lambda_inter, opts);
  route_calls_ = at::zeros({1}, opts.dtype(at::kLong));
  if (config_.router_scale && IsGrouped(config_.method)) {
    // [1, N] as in the released code, whose optimizer decays every matrix.
    router_scale_ = at::ones({1, config_.num_experts}, opts).set_requires_grad(true);
  }
}

at::Tensor RouterLayer::BalanceBias() const { return balance_.lower - balance_.upper; }

uint64_t RouterLayer::DropSeed(bool training) {
  uint64_t call = 0;
  if (training) {
    call = static_cast<uint64_t>(route_calls_.item<int64_t>()) + 1;
    route_calls_.add_(1);
  }
  return SplitMix64(seed_ ^ SplitMix64(call));
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
                                options.seed, options.serving));
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
  const RoutingConfig& c = config_;
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
  RoutingOutput out;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    // fp32 at least; double input stays double (used by gradient checks).
    const at::Tensor g =
        logits.scalar_type() == at::kDouble ? logits : logits.to(at::kFloat);
    const int64_t tokens = g.size(0);
    const bool grouped = IsGrouped(c.method);
    const bool controlled = c.target_expert_cv > 0;
    const at::Tensor p = at::softmax(g, -1);
    // pi: the bias-corrected distribution for himoe, p for every other method.
    at::Tensor pi = p;
    at::Tensor pi_logits = g;
    if (c.method == RoutingMethod::kHiMoe) {
      if (training) UpdateLogitEma(logit_ema_, g, c.ema_beta);
      pi_logits = CorrectedLogits(g, logit_ema_, c.tau, c.temperature);
      pi = at::softmax(pi_logits, -1);
    }

    Selection sel;
    at::Tensor weight_source = pi;
    if (c.method == RoutingMethod::kLossFree) {
      if (c.sigmoid_scores) weight_source = at::sigmoid(g);
      sel = SelectFlatTopK(weight_source + loss_free_bias_, c.total_k());
    } else if (controlled && training) {
      HIMOE_PROFILE_SCOPE("routing: balance solve");
      sel = SelectWithinBand(pi_logits);
    } else {
      sel = Select(controlled ? pi_logits + BalanceBias().to(pi_logits.dtype()) : pi);
    }
    // Serving reads neither the losses nor the statistics beyond the counts.
    const bool serving = serving_ && !training;
    const at::Tensor sparse = serving ? at::Tensor() : SparseSelectedProbs(pi, sel.ids);
    at::Tensor weights = weight_source.gather(1, sel.ids);
    if (c.renormalize) weights = RenormalizeWeights(weights);
    const at::Tensor unscaled_weights = weights;
    if (router_scale_.defined()) {
      weights = weights * router_scale_.view(-1).index_select(0, sel.ids.reshape(-1))
                              .view_as(sel.ids)
                              .to(weights.scalar_type());
    }
    // Per segment: a request's drops depend on its own rows only.
    const bool random_drop = c.method == RoutingMethod::kStMoe && c.second_choice_threshold > 0;
    const uint64_t drop_seed = random_drop ? DropSeed(training) : 0;
    const auto capacity_of = [&](int64_t rows) {
      return c.capacity_rounding == CapacityRounding::kCeil
                 ? ExpertCapacity(c.capacity_factor, c.total_k(), rows, c.num_experts)
                 : ReleasedExpertCapacity(c.capacity_factor, c.total_k(), rows, c.num_experts,
                                          /*round_to_even=*/c.method != RoutingMethod::kLossFree);
    };
    // Dropless without random drops: segments cannot differ, so one pass.
    if (!random_drop && c.capacity_factor <= 0) bounds.assign(1, tokens);
    // Reported: the capacity of the largest segment.
    const int64_t capacity = capacity_of(*std::max_element(bounds.begin(), bounds.end()));
    std::vector<at::Tensor> kept_parts;
    int64_t offset = 0;
    for (const int64_t rows : bounds) {
      const Selection part{sel.ids.narrow(0, offset, rows), sel.rank.narrow(0, offset, rows)};
      at::Tensor active;
      if (random_drop) {
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(drop_seed);
        const at::Tensor u = at::rand(part.ids.sizes(), gen, at::dtype(at::kDouble));
        active = SecondChoiceActiveMask(weights.narrow(0, offset, rows), part.rank, u,
                                        c.second_choice_threshold);
      }
      kept_parts.push_back(CapacityKeepMask(part, c.num_experts, capacity_of(rows), active));
      offset += rows;
    }
    const at::Tensor kept = kept_parts.size() == 1 ? kept_parts[0] : at::cat(kept_parts);

    const at::Tensor zero = at::zeros({}, g.options().requires_grad(false));
    RoutingLosses& losses = out.losses;
    losses.load = losses.intra = losses.inter = losses.z = losses.balance = zero;
    double lambda_intra = 0, lambda_inter = 0;
    if (!serving) {
      const at::Tensor& load_probs = c.load_source == ProbSource::kCorrected ? pi : p;
      const bool released_flat = c.flat_load == FlatLoadForm::kReleased;
      if (c.method == RoutingMethod::kVanilla && released_flat) {
        losses.load =
            ReleasedVanillaLoadLoss(unscaled_weights, sel.ids, c.num_experts, c.alpha);
      } else if (c.method == RoutingMethod::kStMoe && released_flat) {
        losses.load = LoadBalancingLoss(load_probs, sel.ids.narrow(1, 0, 1), c.alpha);
      } else if (c.method != RoutingMethod::kLossFree) {
        losses.load = LoadBalancingLoss(load_probs, sel.ids, c.alpha);
      }
      if (c.method == RoutingMethod::kHiMoe) {
        lambda_intra = c.epsilon_ov > 0 ? lambda_intra_.item<double>() : c.lambda_intra;
        lambda_inter = c.epsilon_sys > 0 ? lambda_inter_.item<double>() : c.lambda_inter;
        const at::Tensor& intra_probs = c.intra_source == ProbSource::kCorrected ? pi : p;
        const auto inter = [&](double lambda) {
          return c.inter_form == InterForm::kSelectedWeights
                     ? InterGroupRegularizer(sparse, lambda)
                     : InterGroupRegularizerDenseGroupMass(p, c.num_groups, lambda);
        };
        losses.intra = IntraGroupRegularizer(intra_probs, lambda_intra);
        losses.inter = inter(lambda_inter);
        if (training && (c.epsilon_ov > 0 || c.epsilon_sys > 0)) {
          // The constraints' costs are the regularizers at lambda = 1, on the
          // distributions the regularizers read: C_ov = 1 - mean ||pi||^2,
          // C_sys = mean ||pi_tilde||^2 (or the dense group mass, reference).
          at::NoGradGuard no_grad;
          if (c.epsilon_ov > 0) {
            const double c_ov = 1.0 + IntraGroupRegularizer(intra_probs, 1.0).item<double>();
            lambda_intra_.fill_(
                DualAscentStep(lambda_intra, c_ov, c.epsilon_ov, c.dual_rate, c.lambda_intra));
          }
          if (c.epsilon_sys > 0) {
            const double c_sys = inter(1.0).item<double>();
            lambda_inter_.fill_(
                DualAscentStep(lambda_inter, c_sys, c.epsilon_sys, c.dual_rate, c.lambda_inter));
          }
        }
      }
      if (c.method == RoutingMethod::kStMoe ||
          (c.released_z_loss && c.method != RoutingMethod::kLossFree)) {
        losses.z = RouterZLoss(g, c.z_coef);
      }

      if (controlled && grouped && training) {
        HIMOE_PROFILE_SCOPE("routing: balance loss");
        // The gate's own picks say how far it is from the target by itself.
        const Selection own = Select(pi_logits);
        // Minus its balanced value 1, so the reported term reads 0 at balance.
        losses.balance = balance_.loss_multiplier.item<double>() *
                         (GroupConditionalLoadLoss(pi, own.ids, c.num_groups, c.top_k) - 1.0);
        at::NoGradGuard no_grad;
        const at::Tensor counts = at::bincount(own.ids.reshape(-1), {}, c.num_experts);
        const double own_cv = CoefficientOfVariation(ToVector(counts));
        balance_.loss_multiplier.fill_(DualAscentStep(balance_.loss_multiplier.item<double>(),
                                                      own_cv, c.target_expert_cv,
                                                      kBalanceLossRate));
      }
      if (training && c.method == RoutingMethod::kLossFree) {
        at::NoGradGuard no_grad;
        if (c.sigmoid_scores) pending_counts_.zero_();  // the last micro-batch only
        pending_counts_.add_(
            at::bincount(sel.ids.reshape(-1), {}, c.num_experts).to(pending_counts_.options()));
      }
    }
    out.stats = serving ? CountStats(c, sel.ids, kept, capacity)
                        : ComputeStats(c, pi, sparse, sel.ids, kept, capacity, BalanceBias());
    out.stats.balance_multiplier = balance_.loss_multiplier.item<double>();
    out.stats.lambda_intra = lambda_intra;
    out.stats.lambda_inter = lambda_inter;
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

Selection RouterLayer::Select(const at::Tensor& scores) const {
  return IsGrouped(config_.method) ? SelectGroupedTopK(scores, config_.num_groups, config_.top_k)
                                   : SelectFlatTopK(scores, config_.total_k());
}

Selection RouterLayer::SelectWithinBand(const at::Tensor& logits) {
  const RoutingConfig& c = config_;
  const double delta = kBalanceBand * c.target_expert_cv;
  const bool grouped = IsGrouped(c.method);
  const int64_t groups = grouped ? c.num_groups : 1, k = grouped ? c.top_k : c.total_k();
  // The step sizes start afresh on every batch; the multipliers carry over.
  BalanceSolve solve;
  solve.upper = ToVector(balance_.upper);
  solve.lower = ToVector(balance_.lower);
  solve.single_precision = balance_.upper.scalar_type() == at::kFloat;
  solve.step.assign(c.num_experts, solve.Stored(c.balance_rate));
  solve.last.assign(c.num_experts, 0.0);
  const at::Tensor host = logits.detach().to(at::kCPU).contiguous();
  const double mean = static_cast<double>(logits.size(0) * groups * k) / c.num_experts;
  for (int iteration = 0;; ++iteration) {
    const std::vector<int64_t> counts = CountSelections(host, solve.Bias(), groups, k);
    double worst = 0;
    for (const int64_t n : counts) worst = std::max(worst, std::abs(n - mean));
    if (worst / mean <= delta || iteration == kMaxBalanceIterations) break;
    BalanceControllerUpdate(solve, counts, c.target_expert_cv, kBalanceBand, c.balance_rate);
  }
  balance_.upper.copy_(at::tensor(solve.upper, at::kDouble));
  balance_.lower.copy_(at::tensor(solve.lower, at::kDouble));
  return Select(logits + BalanceBias().to(logits.dtype()));
}

void RouterLayer::ApplyBiasUpdates() {
  if (config_.method != RoutingMethod::kLossFree) return;
  LossFreeBiasUpdate(loss_free_bias_, pending_counts_, config_.loss_free_rate);
  pending_counts_.zero_();
}

std::vector<GroupDispatch> BuildDispatchPlan(const at::Tensor& expert_ids,
                                             const at::Tensor& weights,
                                             const at::Tensor& kept,
                                             int64_t num_groups,
                                             int64_t experts_per_group) {
  // A counting sort of the kept slots by expert on the host (stable: within
  // an expert, slots ascend), then one gather of the weights; each group's
  // part is a slice. A few loops over T*K ids, where per-group tensor ops
  // cost a decoding step more than its whole selection.
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
