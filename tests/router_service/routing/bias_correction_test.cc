// The Hi-MoE logit EMA and the loss_free bias (spec "Bias correction",
// "Selection").
#include <gtest/gtest.h>

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

std::vector<double> ColumnMean(const Matrix& m) {
  std::vector<double> mean(m[0].size(), 0.0);
  for (const auto& row : m) {
    for (size_t i = 0; i < row.size(); ++i) mean[i] += row[i] / m.size();
  }
  return mean;
}

std::vector<double> EmaValues(RouterLayer& router) {
  const at::Tensor e = router.logit_ema().to(at::kDouble);
  return std::vector<double>(e.data_ptr<double>(), e.data_ptr<double>() + e.numel());
}

TEST(BiasCorrectionTest, EmaUpdatedBeforeUseInTrainingAndMatchesSpec) {
  RoutingConfig config = Config(RoutingMethod::kHiMoe, 4, 2, 1);
  config.ema_beta = 0.9;
  config.tau = 0.5;
  config.temperature = 1.5;
  auto router = MakeRouter(config);
  const Matrix step1 = {{1.0, 0.0, -1.0, 2.0}, {3.0, 1.0, 0.0, 0.0}};
  const Matrix step2 = {{0.5, 0.5, 0.0, -2.0}, {0.0, 2.0, 1.0, 1.0}};

  std::vector<double> ema(4, 0.0);
  for (const Matrix* logits : {&step1, &step2}) {
    const std::vector<double> mean = ColumnMean(*logits);
    for (int i = 0; i < 4; ++i) ema[i] = 0.9 * ema[i] + 0.1 * mean[i];
    const RoutingOutput out = MustRoute(*router, ToTensor(*logits), true);
    const std::vector<double> got = EmaValues(*router);
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[i], ema[i], 1e-6);
    // pi uses the EMA already updated with this batch.
    const auto probs = ToNested<double>(out.probs);
    for (size_t t = 0; t < logits->size(); ++t) {
      std::vector<double> z;
      for (int i = 0; i < 4; ++i) z.push_back(((*logits)[t][i] - 0.5 * ema[i]) / 1.5);
      const std::vector<double> pi = Softmax(z);
      for (int i = 0; i < 4; ++i) EXPECT_NEAR(probs[t][i], pi[i], 1e-6);
    }
  }
}

TEST(BiasCorrectionTest, EvalModeNeverUpdatesEmaButUsesIt) {
  RoutingConfig config = Config(RoutingMethod::kHiMoe, 4, 2, 1);
  config.tau = 1.0;
  auto router = MakeRouter(config);
  router->logit_ema().copy_(at::tensor({1.0, 0.0, 0.0, 0.0}));
  const Matrix logits = {{1.0, 0.9, 0.0, 0.1}};
  const RoutingOutput out = MustRoute(*router, ToTensor(logits), false);
  EXPECT_EQ(EmaValues(*router), (std::vector<double>{1.0, 0.0, 0.0, 0.0}));
  // Corrected scores {0, 0.9, 0, 0.1}: the correction flips group 0 to expert 1.
  EXPECT_EQ(ToNested(out.expert_ids), (std::vector<std::vector<int64_t>>{{1, 3}}));
  const std::vector<double> pi = Softmax({0.0, 0.9, 0.0, 0.1});
  EXPECT_NEAR(ToNested<double>(out.weights)[0][0], pi[1], 1e-6);
}

TEST(BiasCorrectionTest, OtherMethodsLeaveTheEmaAlone) {
  for (const RoutingMethod method : {RoutingMethod::kVanilla, RoutingMethod::kMoge,
                                     RoutingMethod::kStMoe, RoutingMethod::kLossFree}) {
    auto router = MakeRouter(Config(method, 4, 2, 1));
    MustRoute(*router, at::randn({8, 4}, at::kDouble), true);
    EXPECT_TRUE(router->logit_ema().eq(0).all().item<bool>()) << RoutingMethodName(method);
  }
}

TEST(LossFreeBiasTest, UpdateFollowsSignOfMeanMinusCount) {
  RoutingConfig config = Config(RoutingMethod::kLossFree, 4, 2, 1);
  config.loss_free_rate = 0.001;
  auto router = MakeRouter(config);
  // K=2 per token. Counts over both batches: expert 0: 3, 1: 2, 2: 1, 3: 0
  // (mean 1.5) -> sign(mean - c) = {-1, -1, +1, +1}.
  MustRoute(*router, ToTensor({{5.0, 4.0, 0.0, 0.0}, {5.0, 0.0, 4.0, 0.0}}), true);
  MustRoute(*router, ToTensor({{5.0, 4.0, 0.0, 0.0}}), true);
  // Eval traffic does not count.
  MustRoute(*router, ToTensor({{0.0, 0.0, 0.0, 9.0}}), false);
  EXPECT_EQ(ToNested<double>(router->pending_counts().unsqueeze(0))[0],
            (std::vector<double>{3, 2, 1, 0}));
  router->ApplyBiasUpdates();
  const auto bias = ToNested<double>(router->loss_free_bias().unsqueeze(0))[0];
  const std::vector<double> expected = {-0.001, -0.001, 0.001, 0.001};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(bias[i], expected[i], 1e-9);
  EXPECT_TRUE(router->pending_counts().eq(0).all().item<bool>());

  // A balanced step leaves the bias where it is (sign(0) = 0).
  MustRoute(*router, ToTensor({{5.0, 4.0, 0.0, 0.0}, {0.0, 0.0, 5.0, 4.0}}), true);
  router->ApplyBiasUpdates();
  const auto unchanged = ToNested<double>(router->loss_free_bias().unsqueeze(0))[0];
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(unchanged[i], expected[i], 1e-9);
}

TEST(LossFreeBiasTest, BiasUpdateIsNoOpForOtherMethods) {
  auto router = MakeRouter(Config(RoutingMethod::kVanilla, 4, 2, 1));
  MustRoute(*router, ToTensor({{5.0, 4.0, 0.0, 0.0}}), true);
  router->ApplyBiasUpdates();
  EXPECT_TRUE(router->loss_free_bias().eq(0).all().item<bool>());
}

}  // namespace
}  // namespace himoe::router
