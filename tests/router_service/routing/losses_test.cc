// Loss values against hand-computed formulas, and loss gradients against
// finite differences in double precision (spec "Losses").
#include <cmath>

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "router_service/routing/routing_math.h"
#include "tests/router_service/routing/routing_test_util.h"

namespace himoe::router {
namespace {

using testing::Config;
using testing::Matrix;
using testing::MakeRouter;
using testing::MustRoute;
using testing::ToNested;
using testing::ToTensor;

using MethodPreset = std::tuple<RoutingMethod, const char*>;

std::string MethodPresetName(const ::testing::TestParamInfo<MethodPreset>& info) {
  return std::string(RoutingMethodName(std::get<0>(info.param))) + "_" + std::get<1>(info.param);
}

const Matrix kLogits = {
    {0.3, -1.2, 2.0, 0.1, 0.7, -0.4, 1.1, 0.0},  {1.5, 0.2, -0.3, 0.9, -1.0, 0.4, 0.05, 2.2},
    {-0.6, 0.8, 0.3, -0.2, 1.9, 1.0, -1.3, 0.6}, {0.0, 0.45, 1.25, -0.75, 0.2, -0.1, 0.9, 1.4},
    {2.4, -0.5, 0.1, 0.6, 0.3, 1.7, -0.9, -0.2}, {-1.1, 1.3, 0.7, 0.2, -0.3, 0.5, 1.6, 0.35}};

class LossValueTest
    : public ::testing::TestWithParam<MethodPreset> {};

TEST_P(LossValueTest, MatchesHandComputedFormulas) {
  RoutingConfig c = Config(std::get<0>(GetParam()), 8, 4, 1);
  ASSERT_TRUE(testing::ApplyOraclePreset(std::get<1>(GetParam()), &c).ok());
  c.capacity_factor = 0;
  c.tau = 0.5;  // strong correction, so pi != p and the switches matter
  c.ema_beta = 0.5;
  c.temperature = 0.8;
  auto router = MakeRouter(c);
  const RoutingOutput out = MustRoute(*router, ToTensor(kLogits), /*training=*/true);
  // First training step: gbar = (1-beta) mean g, updated before use.
  const std::vector<double> ema = testing::HandEmaUpdate(std::vector<double>(8, 0.0), kLogits,
                                                         c.ema_beta);
  const testing::HandRoute want = testing::HandRouting(c, kLogits, ema);
  ASSERT_GT(testing::HandSelectionMargin(c, want), 1e-3);
  // The selection the losses read comes from the oracle, not from the code.
  EXPECT_EQ(ToNested(out.expert_ids), want.ids);
  const double tol = 1e-9;  // the EMA buffer is stored in fp32
  const Matrix weights = ToNested<double>(out.weights);
  for (size_t t = 0; t < kLogits.size(); ++t) {
    for (size_t j = 0; j < want.weights[t].size(); ++j) {
      EXPECT_NEAR(weights[t][j], want.weights[t][j], 1e-8) << "token " << t << " slot " << j;
    }
  }
  const double load = out.losses.load.item<double>();
  const double intra = out.losses.intra.item<double>();
  const double inter = out.losses.inter.item<double>();
  const double z = out.losses.z.item<double>();
  EXPECT_NEAR(load, want.load, tol);
  EXPECT_NEAR(intra, want.intra, tol);
  EXPECT_NEAR(inter, want.inter, tol);
  EXPECT_NEAR(z, want.z, tol);
  EXPECT_NEAR(out.losses.Total().item<double>(), want.AuxTotal(), tol);
  // Each method uses exactly its terms: read off the code's own output.
  // (When the reference preset turns the z-loss on for moge/himoe, reconcile
  // in testing::ApplyOraclePreset.)
  const RoutingMethod m = c.method;
  const double visible = 1e-4;  // every active term is far above this here
  EXPECT_EQ(std::abs(load) > visible, m != RoutingMethod::kLossFree) << load;
  EXPECT_EQ(load == 0, m == RoutingMethod::kLossFree) << load;
  EXPECT_EQ(std::abs(intra) > visible, m == RoutingMethod::kHiMoe) << intra;
  EXPECT_EQ(intra == 0, m != RoutingMethod::kHiMoe) << intra;
  EXPECT_EQ(std::abs(inter) > visible, m == RoutingMethod::kHiMoe) << inter;
  EXPECT_EQ(inter == 0, m != RoutingMethod::kHiMoe) << inter;
  EXPECT_EQ(std::abs(z) > visible, m == RoutingMethod::kStMoe) << z;
  EXPECT_EQ(z == 0, m != RoutingMethod::kStMoe) << z;
}

INSTANTIATE_TEST_SUITE_P(
    MethodsAndPresets, LossValueTest,
    ::testing::Combine(::testing::ValuesIn(testing::kAllMethods),
                       ::testing::Values("paper", "reference")),
    MethodPresetName);

TEST(LossValueTest, UniformLogitsGiveClosedForms) {
  // p_i = 1/N: L_load = alpha*N*sum_i h_i/N = alpha*K; ||p||^2 = 1/N;
  // ||pi_tilde||^2 = K/N^2; logsumexp = log N.
  const Matrix uniform(3, std::vector<double>(8, 0.25));
  RoutingConfig c = Config(RoutingMethod::kHiMoe, 8, 4, 2);
  c.tau = 0;
  auto router = MakeRouter(c);
  RoutingOutput out = MustRoute(*router, ToTensor(uniform), true);
  EXPECT_NEAR(out.losses.load.item<double>(), 0.01 * 8, 1e-12);
  EXPECT_NEAR(out.losses.intra.item<double>(), -0.1 / 8, 1e-12);
  EXPECT_NEAR(out.losses.inter.item<double>(), 0.05 * 8 / 64.0, 1e-12);
  auto st = MakeRouter(Config(RoutingMethod::kStMoe, 8, 4, 2));
  out = MustRoute(*st, ToTensor(uniform), true);
  EXPECT_NEAR(out.losses.z.item<double>(),
              0.001 * std::pow(std::log(8.0) + 0.25, 2), 1e-12);
}

// f(logits) = total loss + sum(weights * coeff): every path that carries a
// gradient to the gate, including the combine weights.
double Objective(RouterLayer& router, const at::Tensor& logits, const at::Tensor& coeff,
                 at::Tensor* grad) {
  const at::Tensor input = logits.detach().clone().set_requires_grad(grad != nullptr);
  const RoutingOutput out = MustRoute(router, input, /*training=*/false);
  const at::Tensor f = out.losses.Total() + (out.weights * coeff).sum();
  if (grad != nullptr) *grad = torch::autograd::grad({f}, {input})[0];
  return f.item<double>();
}

class LossGradientTest
    : public ::testing::TestWithParam<MethodPreset> {};

TEST_P(LossGradientTest, AutogradMatchesFiniteDifferences) {
  at::manual_seed(7);
  RoutingConfig c = Config(std::get<0>(GetParam()), 8, 4, 1);
  ASSERT_TRUE(testing::ApplyOraclePreset(std::get<1>(GetParam()), &c).ok());
  c.capacity_factor = 0;
  c.tau = 0.3;
  c.temperature = 0.7;
  // Large weights so that every term moves the gradient visibly.
  c.alpha = 0.5;
  c.lambda_intra = 0.7;
  c.lambda_inter = 0.9;
  c.z_coef = 0.2;
  auto router = MakeRouter(c);
  router->logit_ema().copy_(at::randn({8}));
  const at::Tensor logits = at::randn({5, 8}, at::kDouble) * 1.5;
  const at::Tensor coeff = at::randn({5, c.total_k()}, at::kDouble);
  at::Tensor grad;
  Objective(*router, logits, coeff, &grad);
  ASSERT_TRUE(grad.defined());
  const double eps = 1e-6;
  for (int64_t t = 0; t < 5; ++t) {
    for (int64_t i = 0; i < 8; ++i) {
      at::Tensor plus = logits.clone(), minus = logits.clone();
      plus[t][i] += eps;
      minus[t][i] -= eps;
      const double fd = (Objective(*router, plus, coeff, nullptr) -
                         Objective(*router, minus, coeff, nullptr)) / (2 * eps);
      EXPECT_NEAR(grad[t][i].item<double>(), fd, 1e-7) << "logit [" << t << "][" << i << "]";
    }
  }
  EXPECT_GT(grad.abs().sum().item<double>(), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    MethodsAndPresets, LossGradientTest,
    ::testing::Combine(::testing::ValuesIn(testing::kAllMethods),
                       ::testing::Values("paper", "reference")),
    MethodPresetName);

}  // namespace
}  // namespace himoe::router
