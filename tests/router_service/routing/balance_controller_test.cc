// The balance controller (routing_config.h, BalanceControllerUpdate): the
// update by hand, selection with the bias, and the closed loop holding the
// band on a router whose gate prefers one expert per group.
#include <algorithm>
#include <cmath>

#include <gtest/gtest.h>

#include "router_service/routing/routing_math.h"
#include "tests/router_service/routing/routing_test_util.h"

namespace himoe::router {
namespace {

using testing::Config;
using testing::MakeRouter;
using testing::MustRoute;
using testing::ToNested;
using testing::ToTensor;

std::vector<double> Vec(const at::Tensor& t) { return ToNested<double>(t.unsqueeze(0))[0]; }

BalanceSolve Fresh(int n, double rate) {
  BalanceSolve s;
  s.upper.assign(n, 0);
  s.lower.assign(n, 0);
  s.step.assign(n, rate);
  s.last.assign(n, 0);
  s.single_precision = false;
  return s;
}

TEST(BalanceControllerTest, UpdateIsProjectedDualAscentOnTheBand) {
  // counts {30, 10, 20, 20}: mean 20, x = {0.5, -0.5, 0, 0}; target 0.2,
  // band 0.75 -> delta 0.15. The step grows 0.1 -> min(0.12, rate 0.1).
  BalanceSolve s = Fresh(4, 0.1);
  BalanceControllerUpdate(s, {30, 10, 20, 20}, 0.2, 0.75, 0.1);
  // upper_0 = 0.1*(0.5-0.15) = 0.035; lower_1 = 0.1*(0.5-0.15) = 0.035;
  // the rest stay projected at 0.
  const std::vector<double> want_up = {0.035, 0, 0, 0}, want_lo = {0, 0.035, 0, 0};
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(s.upper[i], want_up[i], 1e-15) << i;
    EXPECT_NEAR(s.lower[i], want_lo[i], 1e-15) << i;
  }
  EXPECT_EQ(s.last, (std::vector<double>{0.5, -0.5, 0, 0}));
  // Balanced counts: x = 0 (no sign change), the slack releases the
  // multipliers: upper_0 = max(0, 0.035 + 0.1*(0 - 0.15)) = 0.02.
  BalanceControllerUpdate(s, {20, 20, 20, 20}, 0.2, 0.75, 0.1);
  EXPECT_NEAR(s.upper[0], 0.02, 1e-15);
  EXPECT_NEAR(s.lower[1], 0.02, 1e-15);
  // The load flips to the other side: x_0 = -0.5 after +0.5 two steps ago is
  // no flip against last = 0; set up a direct flip instead.
  BalanceSolve f = Fresh(2, 0.1);
  BalanceControllerUpdate(f, {30, 10}, 0.2, 0.75, 0.1);  // x = +-0.5
  BalanceControllerUpdate(f, {10, 30}, 0.2, 0.75, 0.1);  // flipped
  // Step halves to 0.05: upper_0 = max(0, 0.035 + 0.05*(-0.5-0.15)) = 0.0025,
  // lower_0 = 0.05*(0.5-0.15) = 0.0175.
  EXPECT_NEAR(f.step[0], 0.05, 1e-15);
  EXPECT_NEAR(f.upper[0], 0.0025, 1e-15);
  EXPECT_NEAR(f.lower[0], 0.0175, 1e-15);
  // No counts: nothing moves.
  BalanceSolve z = Fresh(2, 0.1);
  BalanceControllerUpdate(z, {0, 0}, 0.2, 0.75, 0.1);
  EXPECT_EQ(z.upper, (std::vector<double>{0, 0}));
  EXPECT_EQ(z.step, (std::vector<double>{0.1, 0.1}));
  // In single precision every stored value is a float: 0.035 is not.
  BalanceSolve r = Fresh(4, 0.1);
  r.single_precision = true;
  BalanceControllerUpdate(r, {30, 10, 20, 20}, 0.2, 0.75, 0.1);
  EXPECT_EQ(r.upper[0], static_cast<double>(static_cast<float>(0.1 * (0.5 - 0.15))));
  EXPECT_NE(r.upper[0], 0.1 * (0.5 - 0.15));
}

// The hand count: per token, the scores plus the bias (added in the scores'
// precision: fp32 sums rounded to fp32), then the k best of each group by
// repeated linear scans (testing::HandTopIndices; ties to the lower index).
std::vector<int64_t> HandCounts(const testing::Matrix& scores, const std::vector<double>& bias,
                                int groups, int k, bool single_precision) {
  const size_t n = bias.size(), width = n / groups;
  std::vector<int64_t> counts(n, 0);
  for (const auto& row : scores) {
    std::vector<double> biased(n);
    for (size_t i = 0; i < n; ++i) {
      biased[i] = single_precision
                      ? static_cast<double>(static_cast<float>(row[i]) + static_cast<float>(bias[i]))
                      : row[i] + bias[i];
    }
    for (int g = 0; g < groups; ++g) {
      for (const int64_t id : testing::HandTopIndices(biased, g * width, (g + 1) * width, k)) {
        ++counts[id];
      }
    }
  }
  return counts;
}

TEST(BalanceControllerTest, CountSelectionsMatchesAHandCount) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor scores = at::randn({300, 8}, gen);
  const testing::Matrix m = testing::ToMatrix(scores);  // the fp32 values, exactly
  const std::vector<double> bias = {0.3, -0.2, 0.0, 0.5, -0.4, 0.1, 0.2, -0.1};
  for (const int groups : {4, 2}) {
    for (const int k : {1, 2}) {
      EXPECT_EQ(CountSelections(scores, bias, groups, k), HandCounts(m, bias, groups, k, true))
          << groups << " groups, k = " << k;
    }
  }
  EXPECT_EQ(CountSelections(scores, bias, 1, 3), HandCounts(m, bias, 1, 3, true));
  // Double scores add the bias in double. Here the scores are corrected
  // logits (g - tau*gbar)/T computed by hand, as the router hands them over.
  const at::Tensor g = at::randn({300, 8}, gen, at::dtype(at::kDouble));
  const std::vector<double> ema = {0.4, -0.3, 0.9, 0.0, -1.2, 0.6, 0.2, -0.5};
  testing::Matrix corrected = testing::ToMatrix(g);
  for (auto& row : corrected) {
    for (size_t i = 0; i < 8; ++i) row[i] = (row[i] - 0.5 * ema[i]) / 0.8;
  }
  EXPECT_EQ(CountSelections(ToTensor(corrected), bias, 4, 1),
            HandCounts(corrected, bias, 4, 1, false));
  EXPECT_EQ(CountSelections(ToTensor(corrected), bias, 2, 2),
            HandCounts(corrected, bias, 2, 2, false));
  // A hand case: token {1, 0.5 | 0, 0.2}, bias +0.6 on expert 1 flips group 0.
  EXPECT_EQ(CountSelections(ToTensor({{1.0, 0.5, 0.0, 0.2}}), {0, 0.6, 0, 0}, 2, 1),
            (std::vector<int64_t>{0, 1, 0, 1}));
}

// The controller's solve on one training batch, written out by hand from the
// header's rule: from zero multipliers and the step `rate` (stored in fp32,
// as the fp32 state), count the picks on scores + bias; stop once every
// count is within delta = band * target of the mean (or after the last
// allowed update); else move every expert's multipliers by
//   upper <- max(0, upper + step*(x - delta)), lower <- max(0, lower + step*(-x - delta)),
// the step halved where x changed sign, else grown 1.2x up to `rate`.
struct HandBand {
  std::vector<double> bias;
  std::vector<int64_t> counts;
};

HandBand HandSolveBand(const testing::Matrix& scores, int groups, int k, double target,
                       double rate) {
  const size_t n = scores[0].size();
  const auto f32 = [](double v) { return static_cast<double>(static_cast<float>(v)); };
  struct Expert {
    double upper = 0, lower = 0, step = 0, last = 0;
  };
  std::vector<Expert> e(n, Expert{0, 0, f32(rate), 0});
  const double mean = static_cast<double>(scores.size() * groups * k) / n;
  const double delta = kBalanceBand * target;
  HandBand out;
  for (int iteration = 0;; ++iteration) {
    out.bias.assign(n, 0.0);
    for (size_t i = 0; i < n; ++i) {
      out.bias[i] =
          static_cast<double>(static_cast<float>(e[i].lower) - static_cast<float>(e[i].upper));
    }
    out.counts = HandCounts(scores, out.bias, groups, k, false);
    double worst = 0;
    for (const int64_t c : out.counts) worst = std::max(worst, std::abs(c - mean));
    if (worst / mean <= delta || iteration == kMaxBalanceIterations) break;
    for (size_t i = 0; i < n; ++i) {
      const double x = (out.counts[i] - mean) / mean;
      const double s = x * e[i].last < 0 ? e[i].step * 0.5 : std::min(e[i].step * 1.2, rate);
      e[i].upper = f32(std::max(e[i].upper + s * (x - delta), 0.0));
      e[i].lower = f32(std::max(e[i].lower + s * (-x - delta), 0.0));
      e[i].step = f32(s);
      e[i].last = f32(x);
    }
  }
  return out;
}

TEST(BalanceControllerTest, BiasMovesSelectionButNotWeights) {
  // himoe N=4, M=2, k=1, tau=0 (pi = p). Token: logits {1, 0.5, 0, 0.2}.
  RoutingConfig c = Config(RoutingMethod::kHiMoe, 4, 2, 1);
  c.tau = 0;
  c.target_expert_cv = 0.1;
  auto router = MakeRouter(c);
  const at::Tensor g = ToTensor({{1.0, 0.5, 0.0, 0.2}});
  EXPECT_EQ(ToNested(MustRoute(*router, g, false).expert_ids)[0], (std::vector<int64_t>{0, 3}));
  // upper_0 = 0.6 > the 0.5 logit gap: expert 1 wins group 0. Weights stay
  // p (no bias): p_1 = e^0.5 / Z.
  router->balance().upper.copy_(at::tensor({0.6, 0.0, 0.0, 0.0}));
  const RoutingOutput out = MustRoute(*router, g, false);
  EXPECT_EQ(ToNested(out.expert_ids)[0], (std::vector<int64_t>{1, 3}));
  const double z = std::exp(1.0) + std::exp(0.5) + 1.0 + std::exp(0.2);
  EXPECT_NEAR(ToNested<double>(out.weights)[0][0], std::exp(0.5) / z, 1e-12);
  EXPECT_NEAR(out.stats.balance_bias[0], -0.6, 1e-7);
  // With the controller off the same state is ignored.
  c.target_expert_cv = 0;
  auto off = MakeRouter(c);
  off->balance().upper.copy_(at::tensor({0.6, 0.0, 0.0, 0.0}));
  EXPECT_EQ(ToNested(MustRoute(*off, g, false).expert_ids)[0], (std::vector<int64_t>{0, 3}));
}

TEST(BalanceControllerTest, TrainingBatchIsSolvedIntoTheBandEvaluationIsNot) {
  // moge N=4, M=2, k=1, target 0.2 (delta 0.15). Token t prefers experts 0
  // and 2 by 0.01*t + 0.5 logits: every token picks them without a bias.
  RoutingConfig c = Config(RoutingMethod::kMoge, 4, 2, 1);
  c.target_expert_cv = 0.2;
  auto router = MakeRouter(c);
  testing::Matrix rows;
  for (int t = 0; t < 100; ++t) {
    const double gap = 0.5 + 0.01 * t;
    rows.push_back({gap, 0, gap, 0});
  }
  const at::Tensor g = ToTensor(rows);
  const RoutingOutput before = MustRoute(*router, g, false);
  EXPECT_EQ(before.stats.expert_counts, (std::vector<double>{100, 0, 100, 0}));
  const RoutingOutput trained = MustRoute(*router, g, true);
  // Band: every load within 50 +- 7.5, so 43..57 of a group's 100 tokens.
  for (const double count : trained.stats.expert_counts) {
    EXPECT_GE(count, 50 - 7.5);
    EXPECT_LE(count, 50 + 7.5);
  }
  EXPECT_LE(trained.stats.expert_cv, 0.15);
  // The counts, picks and bias against the solve written out by hand.
  const HandBand hand = HandSolveBand(rows, 2, 1, c.target_expert_cv, c.balance_rate);
  EXPECT_EQ(trained.stats.expert_counts,
            std::vector<double>(hand.counts.begin(), hand.counts.end()));
  const std::vector<double> b = Vec(router->BalanceBias());
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(b[i], hand.bias[i], 1e-7) << i;
  // Token t goes to expert 1 iff its gap is below b_1 - b_0 (hand bias).
  const auto trained_ids = ToNested(trained.expert_ids);
  int want_1 = 0;
  for (int t = 0; t < 100; ++t) {
    const bool to_1 = (0.5 + 0.01 * t) + hand.bias[0] < hand.bias[1];
    want_1 += to_1;
    EXPECT_EQ(trained_ids[t][0], to_1 ? 1 : 0) << t;
  }
  EXPECT_EQ(hand.counts[1], want_1);
  // Evaluation uses the stored bias without iterating: same picks, same bias.
  const RoutingOutput eval = MustRoute(*router, g, false);
  EXPECT_TRUE(at::equal(eval.expert_ids, trained.expert_ids));
  EXPECT_EQ(Vec(router->BalanceBias()), b);
  // Weights are pi of the picks, with no bias: p_1 = 1 / (2 + 2 e^gap).
  const auto w = ToNested<double>(eval.weights);
  const auto ids = ToNested(eval.expert_ids);
  for (int t = 0; t < 100; t += 37) {
    const double gap = 0.5 + 0.01 * t;
    const double z = 2 + 2 * std::exp(gap);
    EXPECT_NEAR(w[t][0], (ids[t][0] == 0 ? std::exp(gap) : 1.0) / z, 1e-12) << t;
  }
}

TEST(BalanceControllerTest, GroupConditionalLoadLossByHand) {
  // T=2, N=4, M=2 (S=2), k=1. Group-conditional q of token 0: {0.2, 0.8}
  // and {0.5, 0.5}; token 1: {0.6, 0.4} and {0.9, 0.1}. Picks {1, 2}, {0, 2}.
  const at::Tensor probs =
      ToTensor({{0.02, 0.08, 0.45, 0.45}, {0.3, 0.2, 0.45, 0.05}});
  const at::Tensor ids = at::tensor({1, 2, 0, 2}, at::kLong).view({2, 2});
  // h = {1/2, 1/2, 1, 0}; Q = {0.4, 0.6, 0.7, 0.3}.
  // (1/M) S sum h Q = 0.5 * 2 * (0.2 + 0.3 + 0.7 + 0) = 1.2.
  EXPECT_NEAR(GroupConditionalLoadLoss(probs, ids, 2, 1).item<double>(), 1.2, 1e-12);
  // Balanced picks and q give exactly 1.
  const at::Tensor even = ToTensor({{0.1, 0.1, 0.4, 0.4}, {0.3, 0.3, 0.2, 0.2}});
  const at::Tensor alternate = at::tensor({0, 2, 1, 3}, at::kLong).view({2, 2});
  EXPECT_NEAR(GroupConditionalLoadLoss(even, alternate, 2, 1).item<double>(), 1.0, 1e-12);
  // A group whose mass underflowed to 0 adds nothing (no 0/0): token 1's
  // group 1 has q = {0, 0}, so Q = {0.5, 0.5, 0.25, 0.25} and the loss is
  // 0.5 * 2 * (0.5*0.5 + 0.5*0.5 + 0.5*0.25 + 0.5*0.25) = 0.75.
  const at::Tensor underflow = ToTensor({{0.1, 0.1, 0.4, 0.4}, {0.5, 0.5, 0.0, 0.0}});
  EXPECT_NEAR(GroupConditionalLoadLoss(underflow, alternate, 2, 1).item<double>(), 0.75, 1e-12);
}

TEST(BalanceControllerTest, LossMultiplierRisesWithTheGatesOwnImbalance) {
  // himoe N=4, M=2, k=1, tau=0, target 0.2: every token prefers experts 0
  // and 2, so the gate's own CV is 1 (counts {2, 0, 2, 0}).
  RoutingConfig c = Config(RoutingMethod::kHiMoe, 4, 2, 1);
  c.tau = 0;
  c.target_expert_cv = 0.2;
  auto router = MakeRouter(c);
  const testing::Matrix g = {{1.0, 0.0, 0.5, 0.0}, {2.0, 0.0, 1.0, 0.0}};
  const RoutingOutput first = MustRoute(*router, ToTensor(g), true);
  EXPECT_EQ(first.losses.balance.item<double>(), 0.0);  // mu starts at 0
  // mu = max(0, 0 + 0.01 * (1 - 0.2)) = 0.008.
  EXPECT_NEAR(router->balance().loss_multiplier.item<double>(), 0.008, 1e-9);
  const at::Tensor logits = ToTensor(g).requires_grad_(true);
  const RoutingOutput second = MustRoute(*router, logits, true);
  // The loss uses the gate's own picks {0, 2} for both tokens:
  // h = {1, 0, 1, 0}, Q_0 = mean(e/(e+1), e^2/(e^2+1)), Q_2 = mean(e^.5/(e^.5+1), e/(e+1)).
  const auto sig = [](double z) { return 1.0 / (1.0 + std::exp(-z)); };
  const double q0 = (sig(1.0) + sig(2.0)) / 2, q2 = (sig(0.5) + sig(1.0)) / 2;
  const double want = 0.008 * (0.5 * 2 * (q0 + q2) - 1.0);  // 0 when balanced
  EXPECT_NEAR(second.losses.balance.item<double>(), want, 1e-9);
  EXPECT_NEAR(second.losses.Total().item<double>(),
              second.losses.load.item<double>() + second.losses.intra.item<double>() +
                  second.losses.inter.item<double>() + want,
              1e-9);
  EXPECT_NEAR(second.stats.balance_multiplier, 0.016, 1e-9);
  // The term backpropagates (mu moved in place after the loss was built).
  second.losses.Total().backward();
  ASSERT_TRUE(logits.grad().defined());
  EXPECT_GT(logits.grad().abs().max().item<double>(), 0.0);
  // Evaluation neither moves mu nor needs the bias solve.
  MustRoute(*router, ToTensor(g), false);
  EXPECT_NEAR(router->balance().loss_multiplier.item<double>(), 0.016, 1e-9);
  // Off: no term.
  c.target_expert_cv = 0;
  EXPECT_EQ(MustRoute(*MakeRouter(c), ToTensor(g), true).losses.balance.item<double>(), 0.0);
}

TEST(BalanceControllerTest, RejectsLossFreeAndNegativeTargets) {
  RoutingConfig c = Config(RoutingMethod::kLossFree, 4, 2, 1);
  c.target_expert_cv = 0.1;
  EXPECT_NE(ValidateRoutingConfig(c).message().find("target_expert_cv"), std::string::npos);
  c = Config(RoutingMethod::kHiMoe, 4, 2, 1);
  c.target_expert_cv = -0.5;
  EXPECT_NE(ValidateRoutingConfig(c).message().find("target_expert_cv"), std::string::npos);
  EXPECT_EQ(DefaultTargetExpertCv(RoutingMethod::kHiMoe), 0.1);
  EXPECT_EQ(DefaultTargetExpertCv(RoutingMethod::kMoge), 0.0);
}

TEST(DualAscentTest, StepIsProjectedOntoTheBox) {
  EXPECT_DOUBLE_EQ(DualAscentStep(0.1, 0.7, 0.5, 0.1), 0.12);
  EXPECT_DOUBLE_EQ(DualAscentStep(0.1, 0.3, 0.5, 0.1), 0.08);
  EXPECT_EQ(DualAscentStep(0.01, 0.0, 0.5, 0.1), 0.0);         // 0.01 - 0.05 -> 0
  EXPECT_DOUBLE_EQ(DualAscentStep(0.1, 0.7, 0.5, 0.1, 0.11), 0.11);  // 0.12 -> upper
}

TEST(DualAscentTest, LambdasFollowTheirConstraintsInTraining) {
  // himoe N=4, M=2, k=1, tau=0 (pi = p). Token 0 has uniform logits, token 1
  // (ln 4, 0, 0, 0): p_0 = 1/4 each, p_1 = (4, 1, 1, 1)/7, so
  // mean ||p||^2 = (1/4 + 19/49)/2 and C_ov = 1 - that (0.681). Top-1 per
  // group: token 0 keeps two 1/4's (||pi_tilde||^2 = 1/8), token 1 keeps 4/7
  // and a 1/7 (17/49): C_sys = (1/8 + 17/49)/2 (0.236).
  RoutingConfig c = Config(RoutingMethod::kHiMoe, 4, 2, 1);
  c.tau = 0;
  c.lambda_intra = 0.1;   // the boxes' upper ends
  c.lambda_inter = 0.05;
  c.epsilon_ov = 0.5;
  c.epsilon_sys = 0.1;
  c.dual_rate = 0.1;
  auto router = MakeRouter(c);
  const at::Tensor g =
      ToTensor({{0.0, 0.0, 0.0, 0.0}, {std::log(4.0), 0.0, 0.0, 0.0}});
  const double pi_sq = (0.25 + 19.0 / 49) / 2, c_ov = 1 - pi_sq;
  const double c_sys = (0.125 + 17.0 / 49) / 2;
  const double up_intra = 0.1 * (c_ov - 0.5), up_inter = 0.1 * (c_sys - 0.1);
  // The multipliers start at 0; each batch uses the ones the last one left.
  const RoutingOutput first = MustRoute(*router, g, true);
  EXPECT_EQ(first.losses.intra.item<double>(), 0.0);
  EXPECT_EQ(first.losses.inter.item<double>(), 0.0);
  EXPECT_EQ(first.stats.lambda_intra, 0.0);
  EXPECT_NEAR(router->lambda_intra().item<double>(), up_intra, 1e-6);
  EXPECT_NEAR(router->lambda_inter().item<double>(), up_inter, 1e-6);
  const RoutingOutput second = MustRoute(*router, g, true);
  EXPECT_NEAR(second.losses.intra.item<double>(), -up_intra * pi_sq, 1e-6);
  EXPECT_NEAR(second.losses.inter.item<double>(), up_inter * c_sys, 1e-6);
  EXPECT_NEAR(second.stats.lambda_inter, up_inter, 1e-6);
  // Evaluation uses them and does not move them.
  const RoutingOutput eval = MustRoute(*router, g, false);
  EXPECT_NEAR(eval.stats.lambda_intra, 2 * up_intra, 1e-6);
  EXPECT_NEAR(router->lambda_intra().item<double>(), 2 * up_intra, 1e-6);
  // lambda_inter reaches its bound 0.05 on the 4th batch (4 * 0.0136 > 0.05),
  // lambda_intra its bound 0.1 on the 6th (6 * 0.0181 > 0.1).
  MustRoute(*router, g, true);
  EXPECT_NEAR(router->lambda_inter().item<double>(), 3 * up_inter, 1e-6);
  MustRoute(*router, g, true);
  EXPECT_NEAR(router->lambda_inter().item<double>(), 0.05, 1e-7);
  EXPECT_NEAR(router->lambda_intra().item<double>(), 4 * up_intra, 1e-6);
  MustRoute(*router, g, true);
  MustRoute(*router, g, true);
  EXPECT_NEAR(router->lambda_intra().item<double>(), 0.1, 1e-7);
  EXPECT_NEAR(MustRoute(*router, g, true).losses.intra.item<double>(), -0.1 * pi_sq, 1e-6);

  // A constraint that holds keeps its multiplier at 0: C_sys < 0.3.
  c.epsilon_sys = 0.3;
  auto slack = MakeRouter(c);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(MustRoute(*slack, g, true).losses.inter.item<double>(), 0.0);
  EXPECT_EQ(slack->lambda_inter().item<double>(), 0.0);

  // Off (budgets 0): the fixed lambdas of the config, whatever the batch.
  c.epsilon_ov = c.epsilon_sys = 0;
  auto fixed = MakeRouter(c);
  for (int i = 0; i < 3; ++i) {
    const RoutingOutput out = MustRoute(*fixed, g, true);
    EXPECT_NEAR(out.losses.intra.item<double>(), -0.1 * pi_sq, 1e-6);
    EXPECT_NEAR(out.stats.lambda_inter, 0.05, 1e-9);
  }
  EXPECT_NEAR(fixed->lambda_intra().item<double>(), 0.1, 1e-7);
}

// Closed loop on a frozen gate that sends ~96% of every group's tokens to
// its first expert: without the controller the expert CV stays ~0.9; with
// it every training batch ends inside the band (CV <= delta = 0.075, up to
// the solve stopping at kMaxBalanceIterations: under the target 0.1), and
// evaluation batches, routed with the stored bias, stay near it.
struct LoopResult {
  double max_train_cv = 0;
  double mean_eval_cv = 0;
};

LoopResult Loop(RoutingMethod method, double target, int steps) {
  RoutingConfig c = Config(method, 8, 4, 1);
  c.target_expert_cv = target;
  c.tau = 0;
  auto router = MakeRouter(c, 8, 3);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const at::Tensor offset = at::tensor({2.5, 0.0, 2.5, 0.0, 2.5, 0.0, 2.5, 0.0}, at::kDouble);
  LoopResult r;
  for (int s = 0; s < steps; ++s) {
    const at::Tensor train = at::randn({512, 8}, gen, at::dtype(at::kDouble)) + offset;
    r.max_train_cv = std::max(r.max_train_cv, MustRoute(*router, train, true).stats.expert_cv);
    const at::Tensor eval = at::randn({512, 8}, gen, at::dtype(at::kDouble)) + offset;
    r.mean_eval_cv += MustRoute(*router, eval, false).stats.expert_cv / steps;
  }
  return r;
}

TEST(BalanceControllerTest, ClosedLoopHoldsTheBand) {
  EXPECT_GT(Loop(RoutingMethod::kHiMoe, 0.0, 20).mean_eval_cv, 0.8);  // collapsed
  for (const RoutingMethod method : {RoutingMethod::kHiMoe, RoutingMethod::kVanilla}) {
    const LoopResult r = Loop(method, 0.1, 40);
    // Inside the band up to the last unit count where the solve stops at
    // kMaxBalanceIterations; always under the target.
    EXPECT_LE(r.max_train_cv, 0.1) << RoutingMethodName(method);
    // 512 tokens give a count noise of ~0.04 in CV around the band.
    EXPECT_LT(r.mean_eval_cv, 0.15) << RoutingMethodName(method);
  }
}

}  // namespace
}  // namespace himoe::router
