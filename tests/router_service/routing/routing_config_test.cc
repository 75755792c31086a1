#include "router_service/routing/routing_config.h"

#include <cmath>
#include <functional>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace himoe::router {
namespace {

using ::testing::HasSubstr;

struct BadConfigCase {
  std::string name;
  std::function<void(RoutingConfig&)> mutate;
  std::string message;
};

class InvalidConfigTest : public ::testing::TestWithParam<BadConfigCase> {};

TEST_P(InvalidConfigTest, RejectedWithMessageNamingTheField) {
  RoutingConfig config;
  GetParam().mutate(config);
  const absl::Status status = ValidateRoutingConfig(config);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Config, InvalidConfigTest,
    ::testing::Values(
        BadConfigCase{"NNotDivisibleByM", [](RoutingConfig& c) { c.num_experts = 10; },
                      "num_experts (N=10) must be divisible by num_groups (M=4)"},
        BadConfigCase{"KAboveGroupSize", [](RoutingConfig& c) { c.top_k = 3; },
                      "top_k (k=3) must be in [1, N/M=2]"},
        BadConfigCase{"KZero", [](RoutingConfig& c) { c.top_k = 0; }, "top_k (k=0)"},
        BadConfigCase{"NoExperts", [](RoutingConfig& c) { c.num_experts = 0; },
                      "num_experts (N) must be >= 1"},
        BadConfigCase{"NoGroups", [](RoutingConfig& c) { c.num_groups = 0; },
                      "num_groups (M) must be >= 1"},
        BadConfigCase{"NegativeLambdaIntra", [](RoutingConfig& c) { c.lambda_intra = -0.1; },
                      "lambda_intra must be >= 0, got -0.1"},
        BadConfigCase{"NegativeLambdaInter", [](RoutingConfig& c) { c.lambda_inter = -1; },
                      "lambda_inter must be >= 0, got -1"},
        BadConfigCase{"ZeroTemperature", [](RoutingConfig& c) { c.temperature = 0; },
                      "temperature (T) must be > 0"},
        BadConfigCase{"NanTemperature", [](RoutingConfig& c) { c.temperature = NAN; },
                      "temperature (T) must be > 0, got nan"},
        BadConfigCase{"NegativeTau", [](RoutingConfig& c) { c.tau = -0.01; }, "tau must be >= 0"},
        BadConfigCase{"BetaOne", [](RoutingConfig& c) { c.ema_beta = 1.0; },
                      "ema_beta (beta) must be in [0, 1)"},
        BadConfigCase{"NegativeAlpha", [](RoutingConfig& c) { c.alpha = -1e-3; },
                      "alpha must be >= 0"},
        BadConfigCase{"NegativeZ", [](RoutingConfig& c) { c.z_coef = -1; },
                      "z_coef (c_z) must be >= 0"},
        BadConfigCase{"NegativeCapacity", [](RoutingConfig& c) { c.capacity_factor = -2; },
                      "capacity_factor must be >= 0 (0 = dropless)"},
        BadConfigCase{"InfiniteRate", [](RoutingConfig& c) { c.loss_free_rate = INFINITY; },
                      "loss_free_rate (u) must be >= 0"},
        BadConfigCase{"OverlapBudgetOne", [](RoutingConfig& c) { c.epsilon_ov = 1.0; },
                      "epsilon_ov must be in [0, 1) (0 = fixed lambda_intra), got 1"},
        BadConfigCase{"NegativeSysBudget", [](RoutingConfig& c) { c.epsilon_sys = -0.1; },
                      "epsilon_sys must be in [0, 1] (0 = fixed lambda_inter), got -0.1"},
        BadConfigCase{"NegativeDualRate", [](RoutingConfig& c) { c.dual_rate = -1; },
                      "dual_rate must be >= 0, got -1"},
        BadConfigCase{"BudgetOnMoge",
                      [](RoutingConfig& c) {
                        c.method = RoutingMethod::kMoge;
                        c.epsilon_ov = 0.7;
                      },
                      "epsilon_ov and epsilon_sys must be 0 for moge (only himoe has"}),
    [](const auto& info) { return info.param.name; });

TEST(RoutingConfigTest, DefaultsArePaperAndValid) {
  RoutingConfig c;
  EXPECT_TRUE(ValidateRoutingConfig(c).ok());
  EXPECT_EQ(c.temperature, 1.0);
  EXPECT_EQ(c.lambda_intra, 0.1);
  EXPECT_EQ(c.lambda_inter, 0.05);
  EXPECT_EQ(c.tau, 0.01);
  EXPECT_EQ(c.ema_beta, 0.9);
  EXPECT_EQ(c.alpha, 0.01);
  EXPECT_FALSE(c.renormalize);
  EXPECT_EQ(c.capacity_factor, 0.0);
  EXPECT_EQ(c.experts_per_group(), 2);
  EXPECT_EQ(c.total_k(), 4);
  // The paper's fixed multipliers unless a budget is given.
  EXPECT_EQ(c.epsilon_ov, 0.0);
  EXPECT_EQ(c.epsilon_sys, 0.0);
  EXPECT_EQ(DefaultEpsilonOv(RoutingMethod::kHiMoe), 0.8);
  EXPECT_EQ(DefaultEpsilonSys(RoutingMethod::kHiMoe), 0.3);
  EXPECT_EQ(DefaultEpsilonOv(RoutingMethod::kMoge), 0.0);
  EXPECT_EQ(DefaultEpsilonSys(RoutingMethod::kVanilla), 0.0);
}

void ExpectSwitches(const RoutingConfig& c, bool reference) {
  EXPECT_EQ(c.renormalize, reference);
  EXPECT_EQ(c.inter_form, reference ? InterForm::kDenseGroupMass : InterForm::kSelectedWeights);
  EXPECT_EQ(c.intra_source, reference ? ProbSource::kRaw : ProbSource::kCorrected);
  EXPECT_EQ(c.load_source, reference ? ProbSource::kRaw : ProbSource::kCorrected);
  EXPECT_EQ(c.capacity_factor, reference ? 2.0 : 0.0);
}

TEST(RoutingConfigTest, PresetsFlipEverySwitch) {
  RoutingConfig c;
  ASSERT_TRUE(ApplyPreset("reference", &c).ok());
  ExpectSwitches(c, /*reference=*/true);
  ASSERT_TRUE(ApplyPreset("paper", &c).ok());
  ExpectSwitches(c, /*reference=*/false);
  const absl::Status bad = ApplyPreset("megatron", &c);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("preset 'megatron' is unknown"));
}

TEST(RoutingConfigTest, MethodNamesRoundTrip) {
  for (const char* name : {"vanilla", "st_moe", "loss_free", "moge", "himoe"}) {
    auto method = ParseRoutingMethod(name);
    ASSERT_TRUE(method.ok()) << name;
    EXPECT_EQ(RoutingMethodName(*method), name);
  }
  EXPECT_TRUE(IsGrouped(RoutingMethod::kHiMoe));
  EXPECT_TRUE(IsGrouped(RoutingMethod::kMoge));
  EXPECT_FALSE(IsGrouped(RoutingMethod::kVanilla));
  const auto bad = ParseRoutingMethod("switch");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("method 'switch' is unknown"));
}

}  // namespace
}  // namespace himoe::router
