#include "router_service/routing/routing_strategy.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <ATen/ATen.h>
#include <torch/types.h>

#include "common/profile_scope.h"
#include "common/status_macros.h"

namespace himoe::router {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// The seed of st_moe's second-choice draws: one stream per training call
// (counted in the state, so a resumed run draws the same), a fixed one
// outside training.
uint64_t DropSeed(RouterState& state, bool training) {
  uint64_t call = 0;
  if (training) {
    call = static_cast<uint64_t>(state.route_calls.item<int64_t>()) + 1;
    state.route_calls.add_(1);
  }
  return SplitMix64(state.seed ^ SplitMix64(call));
}

// One batch on its way through a strategy.
struct Batch {
  bool training = false;
  bool serving = false;         // serving outside training: no losses, counts only
  at::Tensor g;                 // the logits, fp32 (double stays double)
  at::Tensor p;                 // softmax(g)
  at::Tensor pi;                // the routing distribution (pi for himoe, p otherwise)
  at::Tensor pi_logits;         // its logits
  at::Tensor weight_source;     // the distribution the combine weights are read from
  Selection sel;                // the picks, [T, K]
  at::Tensor sparse;            // pi_tilde [T, N]; undefined when serving
  at::Tensor unscaled_weights;  // combine weights before the router scale
  at::Tensor weights;           // combine weights
  at::Tensor kept;              // [T, K] bool
  int64_t capacity = -1;        // the largest segment's
  at::Tensor zero;              // a constant zero loss
};

// The pipeline every method shares; each step a method changes is a hook.
class StrategyBase : public RoutingStrategy {
 public:
  explicit StrategyBase(const RoutingConfig& config) : config_(config) {}

  RoutingOutput Route(const at::Tensor& logits, bool training, bool serving,
                      std::vector<int64_t> segments, RouterState& state) const final {
    Batch b;
    b.training = training;
    b.serving = serving && !training;
    // fp32 at least; double input stays double (used by gradient checks).
    b.g = logits.scalar_type() == at::kDouble ? logits : logits.to(at::kFloat);
    b.p = at::softmax(b.g, -1);
    Distribute(b, state);
    Pick(b, state);
    Weigh(b, state);
    Drop(b, std::move(segments), state);
    RoutingOutput out;
    double lambda_intra = 0, lambda_inter = 0;
    out.losses = Losses(b, state, lambda_intra, lambda_inter);
    out.stats = b.serving ? CountStats(config_, b.sel.ids, b.kept, b.capacity)
                          : ComputeStats(config_, b.pi, b.sparse, b.sel.ids, b.kept, b.capacity,
                                         state.BalanceBias());
    out.stats.balance_multiplier = state.balance.loss_multiplier.item<double>();
    out.stats.lambda_intra = lambda_intra;
    out.stats.lambda_inter = lambda_inter;
    out.expert_ids = b.sel.ids;
    out.weights = b.weights;
    out.kept = b.kept;
    out.probs = b.pi;
    return out;
  }

  void ApplyBiasUpdates(RouterState& state) const override {}

 protected:
  const RoutingConfig& config() const { return config_; }
  bool controlled() const { return config_.target_expert_cv > 0; }
  // The distribution the load loss reads (load_source).
  const at::Tensor& LoadProbs(const Batch& b) const {
    return config_.load_source == ProbSource::kCorrected ? b.pi : b.p;
  }

  // Top-k inside every group (grouped methods) or top-K over all N.
  virtual Selection Select(const at::Tensor& scores) const = 0;
  // Sets pi and its logits: p and g for every method but himoe.
  virtual void Distribute(Batch& b, RouterState& state) const {
    b.pi = b.p;
    b.pi_logits = b.g;
  }
  // Sets the picks and the weights' distribution: top-k of pi, or with the
  // balance controller of pi's logits plus its bias (solved on the batch in
  // training, the stored one otherwise).
  virtual void Pick(Batch& b, RouterState& state) const {
    b.weight_source = b.pi;
    if (controlled() && b.training) {
      HIMOE_PROFILE_SCOPE("routing: balance solve");
      b.sel = SelectWithinBand(b.pi_logits, state.balance);
    } else if (controlled()) {
      b.sel = Select(b.pi_logits + state.BalanceBias().to(b.pi_logits.dtype()));
    } else {
      b.sel = Select(b.pi);
    }
  }
  // L_load, or b.zero for a method without one.
  virtual at::Tensor LoadLoss(const Batch& b) const {
    return LoadBalancingLoss(LoadProbs(b), b.sel.ids, config_.alpha);
  }
  virtual bool HasZLoss() const { return config_.released_z_loss; }
  // R_intra and R_inter with the weights they used (himoe).
  virtual void Regularize(const Batch& b, RouterState& state, RoutingLosses& losses,
                          double& lambda_intra, double& lambda_inter) const {}
  // The controller's learned part, in training with a target.
  virtual at::Tensor BalanceLoss(const Batch& b, RouterState& state) const { return b.zero; }
  // Bookkeeping of a training batch's picks (loss_free).
  virtual void RecordPicks(const Batch& b, RouterState& state) const {}
  virtual bool RandomSecondChoiceDrop() const { return false; }
  virtual bool CapacityRoundsToEven() const { return true; }

 private:
  // The controller's training-time selection on `logits` (those of pi):
  // from the multipliers the last batch left, dual ascent until every
  // expert's load is inside the band, at most kMaxBalanceIterations updates.
  Selection SelectWithinBand(const at::Tensor& logits, BalanceState& balance) const;
  // Sets sparse, the combine weights (renormalized, scaled) and unscaled_weights.
  void Weigh(Batch& b, const RouterState& state) const;
  // Sets kept and capacity: capacity and st_moe's random drop, per segment.
  void Drop(Batch& b, std::vector<int64_t> bounds, RouterState& state) const;
  RoutingLosses Losses(Batch& b, RouterState& state, double& lambda_intra,
                       double& lambda_inter) const;
  int64_t Capacity(int64_t rows) const;

  RoutingConfig config_;
};

Selection StrategyBase::SelectWithinBand(const at::Tensor& logits, BalanceState& balance) const {
  const RoutingConfig& c = config_;
  const double delta = kBalanceBand * c.target_expert_cv;
  const bool grouped = IsGrouped(c.method);
  const int64_t groups = grouped ? c.num_groups : 1, k = grouped ? c.top_k : c.total_k();
  // The step sizes start afresh on every batch; the multipliers carry over.
  BalanceSolve solve;
  solve.upper = ToDoubles(balance.upper);
  solve.lower = ToDoubles(balance.lower);
  solve.single_precision = balance.upper.scalar_type() == at::kFloat;
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
  balance.upper.copy_(at::tensor(solve.upper, at::kDouble));
  balance.lower.copy_(at::tensor(solve.lower, at::kDouble));
  return Select(logits + (balance.lower - balance.upper).to(logits.dtype()));
}

void StrategyBase::Weigh(Batch& b, const RouterState& state) const {
  b.sparse = b.serving ? at::Tensor() : SparseSelectedProbs(b.pi, b.sel.ids);
  at::Tensor weights = b.weight_source.gather(1, b.sel.ids);
  if (config_.renormalize) weights = RenormalizeWeights(weights);
  b.unscaled_weights = weights;
  if (state.router_scale.defined()) {
    weights = weights * state.router_scale.view(-1).index_select(0, b.sel.ids.reshape(-1))
                            .view_as(b.sel.ids)
                            .to(weights.scalar_type());
  }
  b.weights = weights;
}

int64_t StrategyBase::Capacity(int64_t rows) const {
  const RoutingConfig& c = config_;
  return c.capacity_rounding == CapacityRounding::kCeil
             ? ExpertCapacity(c.capacity_factor, c.total_k(), rows, c.num_experts)
             : ReleasedExpertCapacity(c.capacity_factor, c.total_k(), rows, c.num_experts,
                                      CapacityRoundsToEven());
}

void StrategyBase::Drop(Batch& b, std::vector<int64_t> bounds, RouterState& state) const {
  // Per segment: a request's drops depend on its own rows only.
  const bool random_drop = RandomSecondChoiceDrop();
  const uint64_t drop_seed = random_drop ? DropSeed(state, b.training) : 0;
  // Dropless without random drops: segments cannot differ, so one pass.
  if (!random_drop && config_.capacity_factor <= 0) bounds.assign(1, b.g.size(0));
  // Reported: the capacity of the largest segment.
  b.capacity = Capacity(*std::max_element(bounds.begin(), bounds.end()));
  std::vector<at::Tensor> kept_parts;
  int64_t offset = 0;
  for (const int64_t rows : bounds) {
    const Selection part{b.sel.ids.narrow(0, offset, rows), b.sel.rank.narrow(0, offset, rows)};
    at::Tensor active;
    if (random_drop) {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(drop_seed);
      const at::Tensor u = at::rand(part.ids.sizes(), gen, at::dtype(at::kDouble));
      active = SecondChoiceActiveMask(b.weights.narrow(0, offset, rows), part.rank, u,
                                      config_.second_choice_threshold);
    }
    kept_parts.push_back(CapacityKeepMask(part, config_.num_experts, Capacity(rows), active));
    offset += rows;
  }
  b.kept = kept_parts.size() == 1 ? kept_parts[0] : at::cat(kept_parts);
}

RoutingLosses StrategyBase::Losses(Batch& b, RouterState& state, double& lambda_intra,
                                   double& lambda_inter) const {
  b.zero = at::zeros({}, b.g.options().requires_grad(false));
  RoutingLosses losses;
  losses.load = losses.intra = losses.inter = losses.z = losses.balance = b.zero;
  // Serving reads neither the losses nor the statistics beyond the counts.
  if (b.serving) return losses;
  losses.load = LoadLoss(b);
  Regularize(b, state, losses, lambda_intra, lambda_inter);
  if (HasZLoss()) losses.z = RouterZLoss(b.g, config_.z_coef);
  if (controlled() && b.training) losses.balance = BalanceLoss(b, state);
  if (b.training) RecordPicks(b, state);
  return losses;
}

// vanilla, st_moe, loss_free: top-K over all N experts.
class FlatStrategy : public StrategyBase {
 public:
  using StrategyBase::StrategyBase;

 protected:
  Selection Select(const at::Tensor& scores) const override {
    return SelectFlatTopK(scores, config().total_k());
  }
};

// moge, himoe: top-k inside every group; the controller's loss teaches the
// gate its balance.
class GroupedStrategy : public StrategyBase {
 public:
  using StrategyBase::StrategyBase;

 protected:
  Selection Select(const at::Tensor& scores) const override {
    return SelectGroupedTopK(scores, config().num_groups, config().top_k);
  }
  at::Tensor BalanceLoss(const Batch& b, RouterState& state) const override {
    HIMOE_PROFILE_SCOPE("routing: balance loss");
    const RoutingConfig& c = config();
    BalanceState& balance = state.balance;
    // The gate's own picks say how far it is from the target by itself.
    const Selection own = Select(b.pi_logits);
    // Minus its balanced value 1, so the reported term reads 0 at balance.
    at::Tensor loss = balance.loss_multiplier.item<double>() *
                      (GroupConditionalLoadLoss(b.pi, own.ids, c.num_groups, c.top_k) - 1.0);
    at::NoGradGuard no_grad;
    const at::Tensor counts = at::bincount(own.ids.reshape(-1), {}, c.num_experts);
    const double own_cv = CoefficientOfVariation(ToDoubles(counts));
    balance.loss_multiplier.fill_(DualAscentStep(balance.loss_multiplier.item<double>(), own_cv,
                                                 c.target_expert_cv, kBalanceLossRate));
    return loss;
  }
};

// vanilla: the GShard load loss (the released form under flat_load).
class VanillaStrategy final : public FlatStrategy {
 public:
  using FlatStrategy::FlatStrategy;

 protected:
  at::Tensor LoadLoss(const Batch& b) const override {
    const RoutingConfig& c = config();
    if (c.flat_load == FlatLoadForm::kReleased) {
      return ReleasedVanillaLoadLoss(b.unscaled_weights, b.sel.ids, c.num_experts, c.alpha);
    }
    return FlatStrategy::LoadLoss(b);
  }
};

// st_moe: vanilla plus the z-loss; the released code's load loss counts the
// first choices only and drops later picks at random.
class StMoeStrategy final : public FlatStrategy {
 public:
  using FlatStrategy::FlatStrategy;

 protected:
  at::Tensor LoadLoss(const Batch& b) const override {
    const RoutingConfig& c = config();
    if (c.flat_load == FlatLoadForm::kReleased) {
      return LoadBalancingLoss(LoadProbs(b), b.sel.ids.narrow(1, 0, 1), c.alpha);
    }
    return FlatStrategy::LoadLoss(b);
  }
  bool HasZLoss() const override { return true; }
  bool RandomSecondChoiceDrop() const override { return config().second_choice_threshold > 0; }
};

// loss_free: selection on the scores plus a per-expert bias that moves after
// each optimizer step; no auxiliary loss.
class LossFreeStrategy final : public FlatStrategy {
 public:
  using FlatStrategy::FlatStrategy;

  void ApplyBiasUpdates(RouterState& state) const override {
    LossFreeBiasUpdate(state.loss_free_bias, state.pending_counts, config().loss_free_rate);
    state.pending_counts.zero_();
  }

 protected:
  // Scores p (sigmoid(g) under sigmoid_scores); top-K of scores + b, weighed
  // by the scores alone.
  void Pick(Batch& b, RouterState& state) const override {
    b.weight_source = config().sigmoid_scores ? at::sigmoid(b.g) : b.pi;
    b.sel = SelectFlatTopK(b.weight_source + state.loss_free_bias, config().total_k());
  }
  at::Tensor LoadLoss(const Batch& b) const override { return b.zero; }
  bool HasZLoss() const override { return false; }
  void RecordPicks(const Batch& b, RouterState& state) const override {
    at::NoGradGuard no_grad;
    if (config().sigmoid_scores) state.pending_counts.zero_();  // the last micro-batch only
    state.pending_counts.add_(at::bincount(b.sel.ids.reshape(-1), {}, config().num_experts)
                                  .to(state.pending_counts.options()));
  }
  bool CapacityRoundsToEven() const override { return false; }
};

// moge: grouped top-k on p with the load loss; no bias correction, no
// regularizers.
class MogeStrategy final : public GroupedStrategy {
 public:
  using GroupedStrategy::GroupedStrategy;
};

// himoe: grouped top-k on the bias-corrected pi, with R_intra and R_inter
// (their weights moved by dual ascent under a budget).
class HiMoeStrategy final : public GroupedStrategy {
 public:
  using GroupedStrategy::GroupedStrategy;

 protected:
  // The EMA is updated first in training, then used (also outside training).
  void Distribute(Batch& b, RouterState& state) const override {
    const RoutingConfig& c = config();
    if (b.training) UpdateLogitEma(state.logit_ema, b.g, c.ema_beta);
    b.pi_logits = CorrectedLogits(b.g, state.logit_ema, c.tau, c.temperature);
    b.pi = at::softmax(b.pi_logits, -1);
  }
  void Regularize(const Batch& b, RouterState& state, RoutingLosses& losses,
                  double& lambda_intra, double& lambda_inter) const override;
};

void HiMoeStrategy::Regularize(const Batch& b, RouterState& state, RoutingLosses& losses,
                               double& lambda_intra, double& lambda_inter) const {
  const RoutingConfig& c = config();
  lambda_intra = c.epsilon_ov > 0 ? state.lambda_intra.item<double>() : c.lambda_intra;
  lambda_inter = c.epsilon_sys > 0 ? state.lambda_inter.item<double>() : c.lambda_inter;
  const at::Tensor& intra_probs = c.intra_source == ProbSource::kCorrected ? b.pi : b.p;
  const auto inter = [&](double lambda) {
    return c.inter_form == InterForm::kSelectedWeights
               ? InterGroupRegularizer(b.sparse, lambda)
               : InterGroupRegularizerDenseGroupMass(b.p, c.num_groups, lambda);
  };
  losses.intra = IntraGroupRegularizer(intra_probs, lambda_intra);
  losses.inter = inter(lambda_inter);
  if (!b.training || (c.epsilon_ov <= 0 && c.epsilon_sys <= 0)) return;
  // The constraints' costs are the regularizers at lambda = 1, on the
  // distributions the regularizers read: C_ov = 1 - mean ||pi||^2,
  // C_sys = mean ||pi_tilde||^2 (or the dense group mass, reference).
  at::NoGradGuard no_grad;
  if (c.epsilon_ov > 0) {
    const double c_ov = 1.0 + IntraGroupRegularizer(intra_probs, 1.0).item<double>();
    state.lambda_intra.fill_(
        DualAscentStep(lambda_intra, c_ov, c.epsilon_ov, c.dual_rate, c.lambda_intra));
  }
  if (c.epsilon_sys > 0) {
    const double c_sys = inter(1.0).item<double>();
    state.lambda_inter.fill_(
        DualAscentStep(lambda_inter, c_sys, c.epsilon_sys, c.dual_rate, c.lambda_inter));
  }
}

}  // namespace

at::Tensor RouterState::BalanceBias() const { return balance.lower - balance.upper; }

absl::StatusOr<std::unique_ptr<RoutingStrategy>> MakeRoutingStrategy(
    const RoutingConfig& config) {
  HIMOE_RETURN_IF_ERROR(ValidateRoutingConfig(config));
  switch (config.method) {
    case RoutingMethod::kVanilla:
      return std::make_unique<VanillaStrategy>(config);
    case RoutingMethod::kStMoe:
      return std::make_unique<StMoeStrategy>(config);
    case RoutingMethod::kLossFree:
      return std::make_unique<LossFreeStrategy>(config);
    case RoutingMethod::kMoge:
      return std::make_unique<MogeStrategy>(config);
    case RoutingMethod::kHiMoe:
      return std::make_unique<HiMoeStrategy>(config);
  }
  return absl::InvalidArgumentError("router: unknown routing method");
}

}  // namespace himoe::router
