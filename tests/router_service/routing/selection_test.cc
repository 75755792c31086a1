// Selection and weights on hand-built logits (spec "Selection").
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "router_service/routing/router_layer.h"
#include "router_service/routing/routing_math.h"
#include "tests/router_service/routing/routing_test_util.h"

namespace himoe::router {
namespace {

using testing::Config;
using testing::Matrix;
using testing::MakeRouter;
using testing::MustRoute;
using testing::Softmax;
using testing::ToNested;
using testing::ToTensor;

// N=4 experts in M=2 groups ({0,1}, {2,3}), k=1 per group, K=2.
const Matrix kSelectionLogits = {{2.0, 1.0, 0.5, 0.0}, {0.0, 3.0, 1.0, 2.0}};

void ExpectWeights(const RoutingOutput& out, const Matrix& probs,
                   const std::vector<std::vector<int64_t>>& ids, bool renormalize) {
  const auto weights = ToNested<double>(out.weights);
  for (size_t t = 0; t < ids.size(); ++t) {
    double sum = 0;
    for (int64_t id : ids[t]) sum += probs[t][id];
    for (size_t j = 0; j < ids[t].size(); ++j) {
      const double expected = probs[t][ids[t][j]] / (renormalize ? sum : 1.0);
      EXPECT_NEAR(weights[t][j], expected, 1e-12) << "token " << t << " slot " << j;
    }
  }
}

struct SelectionCase {
  RoutingMethod method;
  std::vector<std::vector<int64_t>> ids;  // hand-derived
};

class HandSelectionTest : public ::testing::TestWithParam<SelectionCase> {};

TEST_P(HandSelectionTest, MatchesHandComputedIdsAndWeights) {
  for (bool renormalize : {false, true}) {
    RoutingConfig config = Config(GetParam().method, 4, 2, 1);
    config.renormalize = renormalize;
    auto router = MakeRouter(config);
    const RoutingOutput out = MustRoute(*router, ToTensor(kSelectionLogits), /*training=*/false);
    EXPECT_EQ(ToNested(out.expert_ids), GetParam().ids);
    ExpectWeights(out, {Softmax(kSelectionLogits[0]), Softmax(kSelectionLogits[1])}, GetParam().ids,
                  renormalize);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Methods, HandSelectionTest,
    ::testing::Values(
        // Flat: top-2 of all four, best first; token 0 takes both from group 0.
        SelectionCase{RoutingMethod::kVanilla, {{0, 1}, {1, 3}}},
        SelectionCase{RoutingMethod::kStMoe, {{0, 1}, {1, 3}}},
        SelectionCase{RoutingMethod::kLossFree, {{0, 1}, {1, 3}}},
        // Grouped: the best of {0,1}, then the best of {2,3}.
        SelectionCase{RoutingMethod::kMoge, {{0, 2}, {1, 3}}},
        SelectionCase{RoutingMethod::kHiMoe, {{0, 2}, {1, 3}}}),
    [](const auto& info) { return std::string(RoutingMethodName(info.param.method)); });

TEST(SelectionTest, HiMoeWeightsUseTemperature) {
  RoutingConfig config = Config(RoutingMethod::kHiMoe, 4, 2, 1);
  config.temperature = 2.0;
  auto router = MakeRouter(config);
  // Eval mode with gbar = 0: pi = softmax(g / T).
  const RoutingOutput out = MustRoute(*router, ToTensor(kSelectionLogits), false);
  Matrix pi;
  for (const auto& row : kSelectionLogits) {
    std::vector<double> scaled;
    for (double v : row) scaled.push_back(v / 2.0);
    pi.push_back(Softmax(scaled));
  }
  ExpectWeights(out, pi, {{0, 2}, {1, 3}}, false);
}

// Corrected scores (g - tau*gbar)/T of kSelectionLogits, by hand, for a given gbar.
Matrix Corrected(const std::vector<double>& ema, double tau) {
  Matrix out;
  for (const auto& row : kSelectionLogits) {
    std::vector<double> z;
    for (size_t i = 0; i < row.size(); ++i) z.push_back(row[i] - tau * ema[i]);
    out.push_back(z);
  }
  return out;
}

TEST(SelectionTest, HiMoeSelectsOnPiWithANonZeroEma) {
  // gbar = {2, 0, 0, 1.5}, tau = 1, T = 1, eval mode (gbar frozen).
  //   token 0: g - gbar = {0, 1, 0.5, -1.5}  -> group {0,1}: 1, group {2,3}: 2
  //   token 1: g - gbar = {-2, 3, 1, 0.5}    -> group {0,1}: 1, group {2,3}: 2
  // Selection on p would give {0, 2} and {1, 3} (HandSelectionTest).
  const std::vector<double> ema = {2.0, 0.0, 0.0, 1.5};
  const std::vector<std::vector<int64_t>> on_pi = {{1, 2}, {1, 2}};
  const std::vector<std::vector<int64_t>> on_p = {{0, 2}, {1, 3}};
  for (bool renormalize : {false, true}) {
    RoutingConfig config = Config(RoutingMethod::kHiMoe, 4, 2, 1);
    config.tau = 1.0;
    config.renormalize = renormalize;
    auto router = MakeRouter(config);
    router->logit_ema().copy_(at::tensor({2.0, 0.0, 0.0, 1.5}));
    const RoutingOutput out = MustRoute(*router, ToTensor(kSelectionLogits), /*training=*/false);
    EXPECT_EQ(ToNested(out.expert_ids), on_pi);
    const Matrix z = Corrected(ema, 1.0);
    ExpectWeights(out, {Softmax(z[0]), Softmax(z[1])}, on_pi, renormalize);
    EXPECT_EQ(ToNested<double>(router->logit_ema().unsqueeze(0))[0], ema);  // eval: frozen
  }
  // moge ignores the EMA: it selects and weighs on p.
  auto moge = MakeRouter(Config(RoutingMethod::kMoge, 4, 2, 1));
  moge->logit_ema().copy_(at::tensor({2.0, 0.0, 0.0, 1.5}));
  const RoutingOutput out = MustRoute(*moge, ToTensor(kSelectionLogits), false);
  EXPECT_EQ(ToNested(out.expert_ids), on_p);
  ExpectWeights(out, {Softmax(kSelectionLogits[0]), Softmax(kSelectionLogits[1])}, on_p, false);
}

TEST(SelectionTest, HiMoeTrainingSelectsOnPiOfTheUpdatedEma) {
  // gbar0 = {-2, 2, -2, 1}, beta = 0.5, tau = 1, T = 1, training mode.
  // mean_tokens g = {1, 2, 0.75, 1}, so the EMA used is
  //   gbar1 = 0.5*gbar0 + 0.5*mean = {-0.5, 2, -0.625, 1}.
  //   token 0: g - gbar1 = {2.5, -1, 1.125, -1}   -> {0, 2}
  //   token 1: g - gbar1 = {0.5, 1, 1.625, 1}     -> {1, 2}
  // On p token 1 would take {1, 3}; on the stale gbar0 ({2, 1, 3, 1}) {0, 2}.
  RoutingConfig config = Config(RoutingMethod::kHiMoe, 4, 2, 1);
  config.tau = 1.0;
  config.ema_beta = 0.5;
  auto router = MakeRouter(config);
  router->logit_ema().copy_(at::tensor({-2.0, 2.0, -2.0, 1.0}));
  const RoutingOutput out = MustRoute(*router, ToTensor(kSelectionLogits), /*training=*/true);
  const std::vector<std::vector<int64_t>> ids = {{0, 2}, {1, 2}};
  EXPECT_EQ(ToNested(out.expert_ids), ids);
  const std::vector<double> ema1 = {-0.5, 2.0, -0.625, 1.0};
  const auto got = ToNested<double>(router->logit_ema().unsqueeze(0))[0];
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[i], ema1[i], 1e-7) << "gbar[" << i << "]";
  const Matrix z = Corrected(ema1, 1.0);
  ExpectWeights(out, {Softmax(z[0]), Softmax(z[1])}, ids, false);
}

TEST(SelectionTest, LossFreeSelectsOnBiasedScoresButWeighsByP) {
  auto router = MakeRouter(Config(RoutingMethod::kLossFree, 4, 2, 1));
  router->loss_free_bias().copy_(at::tensor({0.0, 0.0, 0.0, 1.0}));
  const RoutingOutput out = MustRoute(*router, ToTensor(kSelectionLogits), false);
  // p + b puts expert 3 first for both tokens; the runner-up is the top p.
  const std::vector<std::vector<int64_t>> ids = {{3, 0}, {3, 1}};
  EXPECT_EQ(ToNested(out.expert_ids), ids);
  ExpectWeights(out, {Softmax(kSelectionLogits[0]), Softmax(kSelectionLogits[1])}, ids, false);
}

TEST(SelectionTest, GroupedPicksExactlyKPerGroupFlatMayNot) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(31);
  const at::Tensor logits = at::randn({256, 16}, gen, at::dtype(at::kDouble)) * 3;
  for (const RoutingMethod method : testing::kAllMethods) {
    const RoutingConfig config = Config(method, 16, 4, 2);
    auto router = MakeRouter(config);
    const RoutingOutput out = MustRoute(*router, logits, false);
    ASSERT_EQ(out.expert_ids.size(1), 8);
    // The ids themselves, against the oracle (gbar = 0, b = 0 here).
    const testing::HandRoute want =
        testing::HandRouting(config, testing::ToMatrix(logits), std::vector<double>(16, 0.0));
    ASSERT_GT(testing::HandSelectionMargin(config, want), 1e-9);
    EXPECT_EQ(ToNested(out.expert_ids), want.ids) << RoutingMethodName(method);
    const at::Tensor groups = at::div(out.expert_ids, 4, "floor");
    const at::Tensor per_group =
        at::zeros({256, 4}, at::kLong).scatter_add_(1, groups, at::ones_like(groups));
    const bool exactly_k = per_group.eq(2).all().item<bool>();
    if (IsGrouped(method)) {
      EXPECT_TRUE(exactly_k) << RoutingMethodName(method);
      EXPECT_DOUBLE_EQ(out.stats.groups_per_token, 4.0);
    } else {
      // Random logits: some token certainly takes 3+ experts from one group.
      EXPECT_FALSE(exactly_k) << RoutingMethodName(method);
      EXPECT_LT(out.stats.groups_per_token, 4.0);
    }
    // Selected ids are distinct per token.
    const at::Tensor sorted = std::get<0>(out.expert_ids.sort(1));
    EXPECT_TRUE(sorted.slice(1, 1).ne(sorted.slice(1, 0, -1)).all().item<bool>());
  }
}

TEST(SelectionTest, DispatchPlanCoversEveryKeptAssignmentSortedByExpert) {
  auto router = MakeRouter(Config(RoutingMethod::kVanilla, 8, 4, 1));
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(37);
  const at::Tensor logits = at::randn({40, 8}, gen, at::dtype(at::kDouble));
  const RoutingOutput out = MustRoute(*router, logits, false);
  const auto ids = ToNested(out.expert_ids);
  EXPECT_EQ(ids, testing::HandRouting(Config(RoutingMethod::kVanilla, 8, 4, 1),
                                      testing::ToMatrix(logits), std::vector<double>(8, 0.0))
                     .ids);
  const auto weights = ToNested<double>(out.weights);
  int64_t total = 0;
  for (int g = 0; g < 4; ++g) {
    const GroupDispatch& d = out.groups[g];
    const auto rows = d.token_rows.accessor<int64_t, 1>();
    const auto expert = d.expert_ids.accessor<int64_t, 1>();
    const auto slots = d.slots.accessor<int64_t, 1>();
    for (int64_t i = 0; i < rows.size(0); ++i) {
      EXPECT_EQ(expert[i] / 2, g);
      if (i > 0) {
        EXPECT_LE(expert[i - 1], expert[i]);
      }
      const int64_t t = slots[i] / 4, j = slots[i] % 4;
      EXPECT_EQ(rows[i], t);
      EXPECT_EQ(ids[t][j], expert[i]);
      EXPECT_DOUBLE_EQ(d.weights[i].item<double>(), weights[t][j]);
    }
    total += rows.size(0);
  }
  EXPECT_EQ(total, 40 * 4);
}

// Drops, two picks of one group per token and an empty group, by hand:
// N = 6 in M = 3 groups of 2, K = 2, slot s = 2t + j.
//   ids  {1, 0}, {1, 3}, {0, 1}, {2, 3};  dropped: slots 2 and 7.
//   group 0: expert 0 at slots 1, 4, expert 1 at slots 0, 5 (slots ascend
//            within an expert); group 1: expert 2 at 6, expert 3 at 3;
//   group 2: nothing.
TEST(SelectionTest, DispatchPlanByHandWithDropsAndAnEmptyGroup) {
  const at::Tensor ids = at::tensor({1, 0, 1, 3, 0, 1, 2, 3}, at::kLong).view({4, 2});
  const at::Tensor weights = (at::arange(8, at::kDouble) / 10).view({4, 2});
  const at::Tensor kept =
      at::tensor({1, 1, 0, 1, 1, 1, 1, 0}, at::kLong).to(at::kBool).view({4, 2});
  const std::vector<GroupDispatch> plan = BuildDispatchPlan(ids, weights, kept, 3, 2);
  ASSERT_EQ(plan.size(), 3u);
  const std::vector<std::vector<int64_t>> slots = {{1, 4, 0, 5}, {6, 3}, {}};
  const std::vector<std::vector<int64_t>> rows = {{0, 2, 0, 2}, {3, 1}, {}};
  const std::vector<std::vector<int64_t>> experts = {{0, 0, 1, 1}, {2, 3}, {}};
  const auto values = [](const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  };
  for (int g = 0; g < 3; ++g) {
    EXPECT_EQ(values(plan[g].slots), slots[g]) << "group " << g;
    EXPECT_EQ(values(plan[g].token_rows), rows[g]) << "group " << g;
    EXPECT_EQ(values(plan[g].expert_ids), experts[g]) << "group " << g;
    ASSERT_EQ(plan[g].weights.numel(), static_cast<int64_t>(slots[g].size()));
    for (size_t i = 0; i < slots[g].size(); ++i) {
      EXPECT_DOUBLE_EQ(plan[g].weights[i].item<double>(), slots[g][i] / 10.0);
    }
  }
}

// A serving router (RouterLayerOptions::serving) routes as an evaluating
// one: the same picks, weights, drops, plan and count statistics, with the
// losses left at zero; in training it is an ordinary router.
TEST(SelectionTest, ServingRoutesAsEvaluationWithoutLosses) {
  for (const RoutingMethod method : testing::kAllMethods) {
    RoutingConfig config = Config(method, 8, 4, 1);
    config.capacity_factor = 1.0;  // some drops
    RouterLayerOptions options;
    options.config = config;
    options.d_model = 4;
    options.seed = 1;
    auto full = RouterLayer::Create(options);
    options.serving = true;
    auto serving = RouterLayer::Create(options);
    ASSERT_TRUE(full.ok() && serving.ok());
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
    const at::Tensor logits = at::randn({24, 8}, gen, at::dtype(at::kDouble));
    const std::vector<int64_t> segments = {10, 14};
    const auto want = (*full)->RouteLogits(logits, /*training=*/false, segments);
    const auto got = (*serving)->RouteLogits(logits, /*training=*/false, segments);
    ASSERT_TRUE(want.ok() && got.ok());
    const std::string name(RoutingMethodName(method));
    // Both against the hand selection and the hand drop rule per segment.
    const testing::HandRoute hand =
        testing::HandRouting(config, testing::ToMatrix(logits), std::vector<double>(8, 0.0));
    ASSERT_GT(testing::HandSelectionMargin(config, hand), 1e-9) << name;
    const testing::Ids hand_kept = testing::HandKeep(config, hand, 0, segments);
    EXPECT_EQ(ToNested(got->expert_ids), hand.ids) << name;
    EXPECT_EQ(ToNested(got->kept), hand_kept) << name;
    EXPECT_EQ(got->stats.dropped, testing::CountDropped(hand_kept)) << name;
    EXPECT_TRUE(at::equal(got->expert_ids, want->expert_ids)) << name;
    EXPECT_TRUE(at::equal(got->weights, want->weights)) << name;
    EXPECT_TRUE(at::equal(got->kept, want->kept)) << name;
    for (int g = 0; g < 4; ++g) {
      EXPECT_TRUE(at::equal(got->groups[g].slots, want->groups[g].slots)) << name;
      EXPECT_TRUE(at::equal(got->groups[g].weights, want->groups[g].weights)) << name;
    }
    EXPECT_EQ(got->stats.expert_counts, want->stats.expert_counts) << name;
    EXPECT_EQ(got->stats.group_counts, want->stats.group_counts) << name;
    EXPECT_EQ(got->stats.expert_cv, want->stats.expert_cv) << name;
    EXPECT_EQ(got->stats.group_cv, want->stats.group_cv) << name;
    EXPECT_EQ(got->stats.groups_per_token, want->stats.groups_per_token) << name;
    EXPECT_EQ(got->stats.dropped, want->stats.dropped) << name;
    EXPECT_GT(want->stats.dropped, 0) << name;
    EXPECT_EQ(got->losses.Total().item<double>(), 0.0) << name;
    if (method != RoutingMethod::kLossFree) {
      EXPECT_GT(want->losses.load.item<double>(), 0.0) << name;
    }
    const auto full_training = (*full)->RouteLogits(logits, /*training=*/true);
    const auto serving_training = (*serving)->RouteLogits(logits, /*training=*/true);
    ASSERT_TRUE(full_training.ok() && serving_training.ok());
    EXPECT_EQ(serving_training->losses.Total().item<double>(),
              full_training->losses.Total().item<double>())
        << name;
    EXPECT_EQ(serving_training->stats.c_sys, full_training->stats.c_sys) << name;
  }
}

}  // namespace
}  // namespace himoe::router
