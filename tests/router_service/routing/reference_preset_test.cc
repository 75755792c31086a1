// The released-code rows of the spec's last table, each against numbers
// computed by hand in the test (plain doubles, no routing code).
#include <algorithm>
#include <cmath>
#include <numeric>

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "router_service/routing/routing_math.h"
#include "tests/router_service/routing/routing_test_util.h"

namespace himoe::router {
namespace {

using testing::Config;
using testing::MakeRouter;
using testing::Matrix;
using testing::MustRoute;
using testing::Softmax;
using testing::ToNested;
using testing::ToTensor;

RoutingConfig Reference(RoutingMethod method, int n, int m, int k) {
  RoutingConfig c = Config(method, n, m, k);
  EXPECT_TRUE(ApplyPreset("reference", &c).ok());
  return c;
}

// Indices of the `k` largest entries, largest first.
std::vector<int> TopK(const std::vector<double>& v, int k) {
  std::vector<int> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return v[a] > v[b]; });
  idx.resize(k);
  return idx;
}

double Sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

TEST(ReferencePresetTest, PresetSetsEveryReleasedRowAndPaperClearsThem) {
  RoutingConfig c = Reference(RoutingMethod::kHiMoe, 8, 4, 1);
  EXPECT_EQ(c.capacity_rounding, CapacityRounding::kReleased);
  EXPECT_EQ(c.flat_load, FlatLoadForm::kReleased);
  EXPECT_TRUE(c.released_z_loss);
  EXPECT_TRUE(c.router_scale);
  EXPECT_EQ(c.second_choice_threshold, 0.2);
  EXPECT_TRUE(c.sigmoid_scores);
  EXPECT_EQ(c.capacity_factor, 2.0);
  ASSERT_TRUE(ApplyPreset("paper", &c).ok());
  EXPECT_EQ(c.capacity_rounding, CapacityRounding::kCeil);
  EXPECT_EQ(c.flat_load, FlatLoadForm::kPaper);
  EXPECT_FALSE(c.released_z_loss);
  EXPECT_FALSE(c.router_scale);
  EXPECT_EQ(c.second_choice_threshold, 0.0);
  EXPECT_FALSE(c.sigmoid_scores);
}

TEST(ReferencePresetTest, CapacityRoundingFloorsThenEvenThenAtLeastFour) {
  // floor(2*4*10/8) = 10, even.
  EXPECT_EQ(ReleasedExpertCapacity(2.0, 4, 10, 8, true), 10);
  // floor(2*4*11/8) = floor(11) = 11 -> 12; loss_free keeps 11.
  EXPECT_EQ(ReleasedExpertCapacity(2.0, 4, 11, 8, true), 12);
  EXPECT_EQ(ReleasedExpertCapacity(2.0, 4, 11, 8, false), 11);
  // floor(1.25*1*13/8) = floor(2.03) = 2 -> at least 4.
  EXPECT_EQ(ReleasedExpertCapacity(1.25, 1, 13, 8, true), 4);
  // floor(2*4*9/8) = floor(9) = 9 -> 10, where the paper's ceil gives 9.
  EXPECT_EQ(ReleasedExpertCapacity(2.0, 4, 9, 8, true), 10);
  EXPECT_EQ(ExpertCapacity(2.0, 4, 9, 8), 9);
  EXPECT_EQ(ReleasedExpertCapacity(0.0, 4, 9, 8, true), -1);
}

TEST(ReferencePresetTest, RouterUsesTheReleasedCapacity) {
  // moge N=4, M=2, k=1 (K=2), T=3, cf 2: floor(2*2*3/4) = 3 -> 4 (even) ->
  // max(4, 4) = 4; the paper's rounding gives ceil(3) = 3.
  RoutingConfig c = Reference(RoutingMethod::kMoge, 4, 2, 1);
  const at::Tensor logits = ToTensor({{1, 0, 0, 1}, {1, 0, 1, 0}, {0, 1, 0, 1}});
  EXPECT_EQ(MustRoute(*MakeRouter(c), logits, false).stats.capacity, 4);
  c.capacity_rounding = CapacityRounding::kCeil;
  EXPECT_EQ(MustRoute(*MakeRouter(c), logits, false).stats.capacity, 3);
  // loss_free: floor(2*2*3/4) = 3, not rounded to even, -> max(3, 4) = 4;
  // with T = 5: floor(5) = 5 stays odd.
  RoutingConfig lf = Reference(RoutingMethod::kLossFree, 4, 2, 1);
  const at::Tensor five = ToTensor({{1, 0, 0, 1}, {1, 0, 1, 0}, {0, 1, 0, 1}, {1, 1, 0, 0},
                                    {0, 0, 1, 1}});
  EXPECT_EQ(MustRoute(*MakeRouter(lf), five, false).stats.capacity, 5);
  RoutingConfig vanilla = Reference(RoutingMethod::kVanilla, 4, 2, 1);
  EXPECT_EQ(MustRoute(*MakeRouter(vanilla), five, false).stats.capacity, 6);
}

const Matrix kPresetLogits = {{0.9, -0.3, 0.2, 1.4, -1.0, 0.5, 0.1, -0.2},
                        {-0.4, 1.1, 0.7, 0.0, 0.3, -0.8, 1.6, 0.2},
                        {0.2, 0.4, -1.2, 0.6, 1.3, 0.9, -0.5, 0.0}};

double HandZLoss(const Matrix& g, double c_z) {
  double sum = 0;
  for (const auto& row : g) {
    double s = 0;
    for (double v : row) s += std::exp(v);
    sum += std::log(s) * std::log(s);
  }
  return c_z * sum / g.size();
}

// The released configs of vanilla, moge and himoe all set the z-loss
// (config/examples/train_nano_moe_{vanilla,groups,himoe}.py, c_z 0.001);
// loss_free has none, and st_moe has it under either preset.
TEST(ReferencePresetTest, ZLossOnTheMethodsWhoseReleasedConfigsSetIt) {
  for (const RoutingMethod method :
       {RoutingMethod::kVanilla, RoutingMethod::kMoge, RoutingMethod::kHiMoe}) {
    RoutingConfig c = Reference(method, 8, 4, 1);
    const RoutingOutput out = MustRoute(*MakeRouter(c), ToTensor(kPresetLogits), false);
    EXPECT_NEAR(out.losses.z.item<double>(), HandZLoss(kPresetLogits, 0.001), 1e-12)
        << RoutingMethodName(method);
    c.released_z_loss = false;
    EXPECT_EQ(MustRoute(*MakeRouter(c), ToTensor(kPresetLogits), false).losses.z.item<double>(), 0.0)
        << RoutingMethodName(method);
  }
  const RoutingConfig loss_free = Reference(RoutingMethod::kLossFree, 8, 4, 1);
  EXPECT_EQ(
      MustRoute(*MakeRouter(loss_free), ToTensor(kPresetLogits), false).losses.z.item<double>(), 0.0);
  RoutingConfig st_moe = Reference(RoutingMethod::kStMoe, 8, 4, 1);
  st_moe.released_z_loss = false;
  EXPECT_NEAR(MustRoute(*MakeRouter(st_moe), ToTensor(kPresetLogits), false).losses.z.item<double>(),
              HandZLoss(kPresetLogits, 0.001), 1e-12);
}

TEST(ReferencePresetTest, RouterScaleMultipliesRenormalizedWeightsAndLearns) {
  // moge, N=8, M=4, k=1: each token takes its top expert in every group.
  RoutingConfig c = Reference(RoutingMethod::kMoge, 8, 4, 1);
  auto router = MakeRouter(c);
  ASSERT_TRUE(router->router_scale().defined());
  EXPECT_EQ(router->router_scale().sizes(), (std::vector<int64_t>{1, 8}));
  EXPECT_TRUE(router->router_scale().eq(1).all().item<bool>());
  const std::vector<double> scale = {0.5, 1.5, 2.0, 0.25, 1.0, 3.0, 0.75, 1.25};
  {
    at::NoGradGuard no_grad;
    router->router_scale().copy_(ToTensor({scale}));
  }
  const RoutingOutput out = MustRoute(*router, ToTensor(kPresetLogits), true);
  const auto ids = ToNested(out.expert_ids);
  const auto w = ToNested<double>(out.weights);
  std::vector<double> grad(8, 0.0);  // d(sum of weights)/d scale_i
  for (size_t t = 0; t < kPresetLogits.size(); ++t) {
    const std::vector<double> p = Softmax(kPresetLogits[t]);
    std::vector<int> want_ids;
    double mass = 0;
    for (int g = 0; g < 4; ++g) {
      const int id = p[2 * g] >= p[2 * g + 1] ? 2 * g : 2 * g + 1;
      want_ids.push_back(id);
      mass += p[id];
    }
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(ids[t][j], want_ids[j]);
      EXPECT_NEAR(w[t][j], p[want_ids[j]] / mass * scale[want_ids[j]], 1e-12);
      grad[want_ids[j]] += p[want_ids[j]] / mass;
    }
  }
  out.weights.sum().backward();
  const auto got = ToNested<double>(router->router_scale().grad());
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(got[0][i], grad[i], 1e-6) << i;  // fp32 scale
  // Flat methods have no scale (the released code has it in MoGERouter only).
  EXPECT_FALSE(MakeRouter(Reference(RoutingMethod::kVanilla, 8, 4, 1))->router_scale().defined());
}

TEST(ReferencePresetTest, VanillaLoadLossUsesSelectedWeightsAndAssignmentFractions) {
  // vanilla N=8, M=2, k=2 -> K=4 picks over all 8.
  const RoutingConfig c = Reference(RoutingMethod::kVanilla, 8, 2, 2);
  const RoutingOutput out = MustRoute(*MakeRouter(c), ToTensor(kPresetLogits), false);
  std::vector<double> counts(8, 0.0), weight_sum(8, 0.0);
  for (const auto& row : kPresetLogits) {
    const std::vector<double> p = Softmax(row);
    const std::vector<int> top = TopK(p, 4);
    double mass = 0;
    for (int i : top) mass += p[i];
    for (int i : top) {
      counts[i] += 1;
      weight_sum[i] += p[i] / mass;
    }
  }
  const double T = kPresetLogits.size(), K = 4;
  double want = 0;
  for (int i = 0; i < 8; ++i) want += (counts[i] / (T * K)) * (weight_sum[i] / T);
  want *= 0.01 * 8;
  EXPECT_NEAR(out.losses.load.item<double>(), want, 1e-12);
}

TEST(ReferencePresetTest, StMoeLoadLossCountsTopOneChoicesOnly) {
  RoutingConfig c = Reference(RoutingMethod::kStMoe, 8, 2, 1);  // K = 2
  const RoutingOutput out = MustRoute(*MakeRouter(c), ToTensor(kPresetLogits), false);
  std::vector<double> top1(8, 0.0), p_mean(8, 0.0);
  for (const auto& row : kPresetLogits) {
    const std::vector<double> p = Softmax(row);
    top1[TopK(p, 1)[0]] += 1;
    for (int i = 0; i < 8; ++i) p_mean[i] += p[i] / kPresetLogits.size();
  }
  double want = 0;
  for (int i = 0; i < 8; ++i) want += top1[i] / kPresetLogits.size() * p_mean[i];
  want *= 0.01 * 8;
  EXPECT_NEAR(out.losses.load.item<double>(), want, 1e-12);
}

TEST(ReferencePresetTest, StMoeDropsSecondChoicesAtRandomBelowTheThreshold) {
  // N=4, M=2, k=1 -> K=2 over all 4. Token kind A: second-choice weight
  // renormalizes to 0.4 (>= 0.2: always kept). Kind B: to w = 0.01 (kept
  // with probability w/0.2 = 0.05).
  RoutingConfig c = Reference(RoutingMethod::kStMoe, 4, 2, 1);
  c.capacity_factor = 0;  // isolate the drop from capacity
  const double wb = 0.01;
  const double gap_b = std::log((1 - wb) / wb);  // p1/p2 = (1-w)/w
  const double gap_a = std::log(0.6 / 0.4);
  const int kTokens = 4000;
  Matrix logits;
  for (int t = 0; t < kTokens; ++t) {
    logits.push_back(t % 2 == 0 ? std::vector<double>{gap_a, 0, -20, -20}
                                : std::vector<double>{gap_b, 0, -20, -20});
  }
  auto router = MakeRouter(c, 4, /*seed=*/7);
  const RoutingOutput out = MustRoute(*router, ToTensor(logits), true);
  const auto kept = ToNested(out.kept);
  const auto w = ToNested<double>(out.weights);
  // The oracle: the hand selection and weights, draws from a generator
  // seeded as the first training call's (router seed 7, call 1), and the
  // hand drop rule; nothing read from the code's kept mask.
  const testing::HandRoute want =
      testing::HandRouting(c, logits, std::vector<double>(4, 0.0));
  const testing::Ids want_kept = testing::HandKeep(c, want, testing::HandDropSeed(7, 1));
  int kept_b = 0;
  for (int t = 0; t < kTokens; ++t) {
    ASSERT_EQ(want_kept[t][0], 1) << t;  // first choices always stay
    if (t % 2 == 0) {
      EXPECT_NEAR(w[t][1], 0.4, 1e-9);
      EXPECT_EQ(want_kept[t][1], 1) << t;
    } else {
      EXPECT_NEAR(w[t][1], wb, 1e-9);
      kept_b += want_kept[t][1];
    }
  }
  EXPECT_EQ(kept, want_kept);
  // Binomial(2000, 0.05): mean 100, sd 9.7; 5 sd either side.
  EXPECT_GT(kept_b, 100 - 49);
  EXPECT_LT(kept_b, 100 + 49);
  EXPECT_EQ(out.stats.dropped, testing::CountDropped(want_kept));
  EXPECT_EQ(testing::CountDropped(want_kept), kTokens / 2 - kept_b);
  int64_t dispatched = 0;
  for (const GroupDispatch& d : out.groups) dispatched += d.token_rows.numel();
  EXPECT_EQ(dispatched, kTokens + kTokens / 2 + kept_b);
  // Training draws advance with the call count (a resumed run replays them
  // from the saved count); evaluation draws are one fixed stream (call 0).
  EXPECT_EQ(router->route_calls().item<int64_t>(), 1);
  auto twin = MakeRouter(c, 4, 7);
  EXPECT_EQ(ToNested(MustRoute(*twin, ToTensor(logits), true).kept), want_kept);
  const testing::Ids second = testing::HandKeep(c, want, testing::HandDropSeed(7, 2));
  ASSERT_NE(second, want_kept);
  EXPECT_EQ(ToNested(MustRoute(*twin, ToTensor(logits), true).kept), second);
  const testing::Ids eval = testing::HandKeep(c, want, testing::HandDropSeed(7, 0));
  EXPECT_EQ(ToNested(MustRoute(*twin, ToTensor(logits), false).kept), eval);
  EXPECT_EQ(ToNested(MustRoute(*router, ToTensor(logits), false).kept), eval);
}

// Every method under the reference preset with every released row on at once
// (capacity with the released rounding, st_moe's random drop, the router
// scale, the z-loss, the released load losses, sigmoid scores), in training,
// against testing::HandRouting, HandKeep and HandGradient: ids, weights,
// kept mask, capacity, dropped count, each loss and the logits' gradient.
TEST(ReferencePresetTest, ReleasedRowsMatchTheHandRouting) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(23);
  constexpr int64_t kT = 14;
  const at::Tensor logits = at::randn({kT, 8}, gen, at::dtype(at::kDouble)) * 2;
  const Matrix g = testing::ToMatrix(logits);
  const std::vector<double> scale = {0.5, 1.5, 2.0, 0.25, 1.0, 0.75, 1.25, 3.0};
  const std::vector<double> bias = {0.05, -0.03, 0.0, 0.02, -0.04, 0.01, 0.03, -0.02};
  for (const RoutingMethod method : testing::kAllMethods) {
    for (const auto& [m, k] : {std::pair{4, 1}, std::pair{2, 2}}) {
      SCOPED_TRACE(std::string(RoutingMethodName(method)) + " k=" + std::to_string(k));
      RoutingConfig c = Reference(method, 8, m, k);
      // K = 4: floor(4*14/8) = 7, made 8 but for loss_free; some drops.
      c.capacity_factor = 1.0;
      c.tau = 0.3;
      c.z_coef = 0.05;
      auto router = MakeRouter(c, 4, /*seed=*/5);
      const std::vector<double> ema0 = {0.5, -0.25, 1.0, 0.0, -0.5, 0.75, 0.25, -1.0};
      router->logit_ema().copy_(at::tensor(ema0, at::kDouble));
      std::vector<double> hand_bias, hand_scale;
      if (method == RoutingMethod::kLossFree) {
        router->loss_free_bias().copy_(at::tensor(bias, at::kDouble));
        hand_bias = testing::ToVector(router->loss_free_bias());  // fp32-rounded
      }
      if (router->router_scale().defined()) {
        at::NoGradGuard no_grad;
        router->router_scale().copy_(ToTensor({scale}));
        hand_scale = scale;
      }
      const std::vector<double> ema = method == RoutingMethod::kHiMoe
                                          ? testing::HandEmaUpdate(ema0, g, c.ema_beta)
                                          : ema0;
      const testing::HandRoute want = testing::HandRouting(c, g, ema, hand_bias, hand_scale);
      ASSERT_GT(testing::HandSelectionMargin(c, want), 1e-6);
      // gbar is stored in fp32: values within a few fp32 ulps.
      constexpr double kTol = 1e-7;
      const testing::Ids want_kept = testing::HandKeep(c, want, testing::HandDropSeed(5, 1));

      const at::Tensor input = logits.clone().set_requires_grad(true);
      const RoutingOutput out = MustRoute(*router, input, /*training=*/true);
      EXPECT_EQ(ToNested(out.expert_ids), want.ids);
      const auto w = ToNested<double>(out.weights);
      for (int64_t t = 0; t < kT; ++t) {
        for (size_t j = 0; j < want.weights[t].size(); ++j) {
          EXPECT_NEAR(w[t][j], want.weights[t][j], kTol) << t << ", " << j;
        }
      }
      EXPECT_EQ(out.stats.capacity, testing::HandCapacity(c, kT));
      EXPECT_EQ(ToNested(out.kept), want_kept);
      EXPECT_EQ(out.stats.dropped, testing::CountDropped(want_kept));
      EXPECT_NEAR(out.losses.load.item<double>(), want.load, kTol);
      EXPECT_NEAR(out.losses.intra.item<double>(), want.intra, kTol);
      EXPECT_NEAR(out.losses.inter.item<double>(), want.inter, kTol);
      EXPECT_NEAR(out.losses.z.item<double>(), want.z, kTol);

      Matrix coeff;
      for (int64_t t = 0; t < kT; ++t) {
        coeff.emplace_back();
        for (int j = 0; j < c.total_k(); ++j) coeff.back().push_back(0.1 * ((t + 3 * j) % 7) - 0.3);
      }
      const at::Tensor f = out.losses.Total() + (out.weights * ToTensor(coeff)).sum();
      const Matrix got = testing::ToMatrix(torch::autograd::grad({f}, {input})[0]);
      const Matrix hand = testing::HandGradient(c, g, ema, hand_bias, hand_scale, coeff);
      for (int64_t t = 0; t < kT; ++t) {
        for (int i = 0; i < 8; ++i) {
          EXPECT_NEAR(got[t][i], hand[t][i], kTol) << "logit [" << t << "][" << i << "]";
        }
      }
    }
  }
}

TEST(ReferencePresetTest, LossFreeScoresAreSigmoidsAndItsUpdateUsesTheLastMicroBatch) {
  // N=4, M=2, k=1 -> K=2 over all 4; weights = sigmoid scores renormalized.
  RoutingConfig c = Reference(RoutingMethod::kLossFree, 4, 2, 1);
  c.capacity_factor = 0;
  auto router = MakeRouter(c);
  {
    at::NoGradGuard no_grad;
    router->loss_free_bias().copy_(at::tensor({0.0, 0.0, 0.3, 0.0}));
  }
  // Token 0: sigmoid scores 0.73, 0.5, 0.27, 0.62; with the bias expert 2 has
  // 0.57 < 0.62 and stays out. Token 1: expert 2 at 0.45 + 0.3 = 0.75 wins.
  const Matrix g1 = {{1.0, 0.0, -1.0, 0.5}, {1.0, 0.4, -0.2, -2.0}};
  const RoutingOutput out = MustRoute(*router, ToTensor(g1), true);
  const auto ids = ToNested(out.expert_ids);
  const auto w = ToNested<double>(out.weights);
  const std::vector<std::vector<int>> want_ids = {{0, 3}, {2, 0}};
  for (int t = 0; t < 2; ++t) {
    std::vector<double> biased(4);
    for (int i = 0; i < 4; ++i) biased[i] = Sigmoid(g1[t][i]) + (i == 2 ? 0.3 : 0.0);
    ASSERT_EQ(TopK(biased, 2), want_ids[t]);
    const double mass = Sigmoid(g1[t][want_ids[t][0]]) + Sigmoid(g1[t][want_ids[t][1]]);
    for (int j = 0; j < 2; ++j) {
      EXPECT_EQ(ids[t][j], want_ids[t][j]);
      EXPECT_NEAR(w[t][j], Sigmoid(g1[t][want_ids[t][j]]) / mass, 1e-12);
    }
  }
  // A second micro-batch: both tokens pick experts 1 and 3. The update sees
  // its counts only, {0, 2, 0, 2}: b += 0.001 * sign(1 - c).
  MustRoute(*router, ToTensor({{-3, 2, -3, 1}, {-3, 1, -3, 2}}), true);
  router->ApplyBiasUpdates();
  const auto bias = ToNested<double>(router->loss_free_bias().unsqueeze(0))[0];
  const std::vector<double> want = {0.001, -0.001, 0.3 + 0.001, -0.001};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(bias[i], want[i], 1e-7) << i;
}

}  // namespace
}  // namespace himoe::router
