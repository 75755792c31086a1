// Loss values against hand-computed formulas, and loss gradients against
// the hand-derived gradient of the same formulas, in double precision (spec
// "Losses", both presets' rows).
#include <cmath>

#include <ATen/CPUGeneratorImpl.h>
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

using testing::MethodPreset;
using testing::MethodPresetName;

const Matrix kLossLogits = {
    {0.3, -1.2, 2.0, 0.1, 0.7, -0.4, 1.1, 0.0},  {1.5, 0.2, -0.3, 0.9, -1.0, 0.4, 0.05, 2.2},
    {-0.6, 0.8, 0.3, -0.2, 1.9, 1.0, -1.3, 0.6}, {0.0, 0.45, 1.25, -0.75, 0.2, -0.1, 0.9, 1.4},
    {2.4, -0.5, 0.1, 0.6, 0.3, 1.7, -0.9, -0.2}, {-1.1, 1.3, 0.7, 0.2, -0.3, 0.5, 1.6, 0.35}};

class LossValueTest
    : public ::testing::TestWithParam<MethodPreset> {};

TEST_P(LossValueTest, MatchesHandComputedFormulas) {
  RoutingConfig c = Config(std::get<0>(GetParam()), 8, 4, 1);
  ASSERT_TRUE(ApplyPreset(std::get<1>(GetParam()), &c).ok());
  c.capacity_factor = 0;
  c.tau = 0.5;  // strong correction, so pi != p and the switches matter
  c.ema_beta = 0.5;
  c.temperature = 0.8;
  auto router = MakeRouter(c);
  const RoutingOutput out = MustRoute(*router, ToTensor(kLossLogits), /*training=*/true);
  // First training step: gbar = (1-beta) mean g, updated before use.
  const std::vector<double> ema = testing::HandEmaUpdate(std::vector<double>(8, 0.0), kLossLogits,
                                                         c.ema_beta);
  const testing::HandRoute want = testing::HandRouting(c, kLossLogits, ema);
  ASSERT_GT(testing::HandSelectionMargin(c, want), 1e-3);
  // The selection the losses read comes from the oracle, not from the code.
  EXPECT_EQ(ToNested(out.expert_ids), want.ids);
  const double tol = 1e-9;  // the EMA buffer is stored in fp32
  const Matrix weights = ToNested<double>(out.weights);
  for (size_t t = 0; t < kLossLogits.size(); ++t) {
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
  // Each method uses exactly its terms.
  const RoutingMethod m = c.method;
  const bool z_on = testing::HandZLossOn(c);
  const double visible = 1e-4;  // every active term is far above this here
  EXPECT_EQ(std::abs(load) > visible, m != RoutingMethod::kLossFree) << load;
  EXPECT_EQ(load == 0, m == RoutingMethod::kLossFree) << load;
  EXPECT_EQ(std::abs(intra) > visible, m == RoutingMethod::kHiMoe) << intra;
  EXPECT_EQ(intra == 0, m != RoutingMethod::kHiMoe) << intra;
  EXPECT_EQ(std::abs(inter) > visible, m == RoutingMethod::kHiMoe) << inter;
  EXPECT_EQ(inter == 0, m != RoutingMethod::kHiMoe) << inter;
  EXPECT_EQ(std::abs(z) > visible, z_on) << z;
  EXPECT_EQ(z == 0, !z_on) << z;
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

class LossGradientTest : public ::testing::TestWithParam<MethodPreset> {};

// f = total loss + sum(weights * coeff) through the router, in evaluation and
// in training (gbar updated with the batch before use), against
// testing::HandObjective and its hand-derived gradient testing::HandGradient;
// the router scale's gradient (released grouped rows) against its own hand
// formula, sum over the picks of the expert of coeff * unscaled weight.
TEST_P(LossGradientTest, AutogradMatchesTheHandDerivedGradient) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto randn = [&](std::vector<int64_t> size) {
    return at::randn(size, gen, at::dtype(at::kDouble));
  };
  RoutingConfig c = Config(std::get<0>(GetParam()), 8, 4, 1);
  ASSERT_TRUE(ApplyPreset(std::get<1>(GetParam()), &c).ok());
  c.capacity_factor = 0;
  c.tau = 0.3;
  c.temperature = 0.7;
  c.ema_beta = 0.8;
  // Large weights so that every term moves the gradient visibly.
  c.alpha = 0.5;
  c.lambda_intra = 0.7;
  c.lambda_inter = 0.9;
  c.z_coef = 0.2;
  const int64_t tokens = 5;
  const at::Tensor ema0 = randn({8}).to(at::kFloat);  // the buffer is fp32
  const at::Tensor bias0 = (randn({8}) * 0.05).to(at::kFloat);
  const at::Tensor logits = randn({tokens, 8}) * 1.5;
  const Matrix g = testing::ToMatrix(logits);
  const Matrix coeff = testing::ToMatrix(randn({tokens, c.total_k()}));
  // Powers of two: exact in the fp32 scale.
  const std::vector<double> scale = {0.5, 1.5, 2.0, 0.25, 1.0, 0.75, 1.25, 3.0};
  for (const bool training : {false, true}) {
    SCOPED_TRACE(training ? "training" : "evaluation");
    auto router = MakeRouter(c);
    router->logit_ema().copy_(ema0);
    std::vector<double> bias;
    if (c.method == RoutingMethod::kLossFree) {
      router->loss_free_bias().copy_(bias0);
      bias = testing::ToVector(bias0);
    }
    std::vector<double> hand_scale;
    if (router->router_scale().defined()) {
      at::NoGradGuard no_grad;
      router->router_scale().copy_(ToTensor({scale}));
      hand_scale = scale;
    }
    const std::vector<double> ema =
        training && c.method == RoutingMethod::kHiMoe
            ? testing::HandEmaUpdate(testing::ToVector(ema0), g, c.ema_beta)
            : testing::ToVector(ema0);
    const testing::HandRoute want = testing::HandRouting(c, g, ema, bias, hand_scale);
    ASSERT_GT(testing::HandSelectionMargin(c, want), 1e-4);

    const at::Tensor input = logits.clone().set_requires_grad(true);
    const RoutingOutput out = MustRoute(*router, input, training);
    ASSERT_EQ(ToNested(out.expert_ids), want.ids);
    const at::Tensor f = out.losses.Total() + (out.weights * ToTensor(coeff)).sum();
    EXPECT_NEAR(f.item<double>(), testing::HandObjective(c, g, ema, bias, hand_scale, coeff),
                1e-7);
    std::vector<at::Tensor> wrt = {input};
    if (router->router_scale().defined()) wrt.push_back(router->router_scale());
    const std::vector<at::Tensor> grads = torch::autograd::grad({f}, wrt);
    const Matrix got = testing::ToMatrix(grads[0]);
    const Matrix hand = testing::HandGradient(c, g, ema, bias, hand_scale, coeff);
    double size = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = 0; i < 8; ++i) {
        // fp32 gbar: the hand side reads the same rounded values, so only the
        // order of the sums differs.
        EXPECT_NEAR(got[t][i], hand[t][i], 1e-7) << "logit [" << t << "][" << i << "]";
        size += std::abs(hand[t][i]);
      }
    }
    EXPECT_GT(size, 1e-3);
    if (router->router_scale().defined()) {
      std::vector<double> want_scale(8, 0.0);
      for (int64_t t = 0; t < tokens; ++t) {
        for (size_t j = 0; j < want.ids[t].size(); ++j) {
          want_scale[want.ids[t][j]] += coeff[t][j] * want.unscaled[t][j];
        }
      }
      const std::vector<double> got_scale = testing::ToVector(grads[1]);
      for (int i = 0; i < 8; ++i) EXPECT_NEAR(got_scale[i], want_scale[i], 1e-6) << i;
    }
  }
}

// The hand-derived gradient is the derivative of the hand objective: central
// differences of HandObjective, both sides plain doubles.
TEST_P(LossGradientTest, HandGradientIsTheDerivativeOfTheHandObjective) {
  RoutingConfig c = Config(std::get<0>(GetParam()), 8, 4, 1);
  ASSERT_TRUE(ApplyPreset(std::get<1>(GetParam()), &c).ok());
  c.tau = 0.3;
  c.temperature = 0.7;
  c.alpha = 0.5;
  c.lambda_intra = 0.7;
  c.lambda_inter = 0.9;
  c.z_coef = 0.2;
  const Matrix g(kLossLogits.begin(), kLossLogits.begin() + 5);
  const std::vector<double> ema = {0.4, -1.0, 0.3, 0.8, -0.2, 0.6, -0.7, 0.1};
  const std::vector<double> bias = {0.01, -0.02, 0.03, 0.0, -0.01, 0.02, 0.0, 0.01};
  const std::vector<double> scale = {0.5, 1.5, 2.0, 0.25, 1.0, 0.75, 1.25, 3.0};
  Matrix coeff;
  for (int t = 0; t < 5; ++t) coeff.push_back({0.3 * t - 0.5, 0.7, -0.4 + 0.1 * t, 1.1});
  const Matrix hand = testing::HandGradient(c, g, ema, bias, scale, coeff);
  const double eps = 1e-6;
  for (int t = 0; t < 5; ++t) {
    for (int i = 0; i < 8; ++i) {
      Matrix plus = g, minus = g;
      plus[t][i] += eps;
      minus[t][i] -= eps;
      const double fd = (testing::HandObjective(c, plus, ema, bias, scale, coeff) -
                         testing::HandObjective(c, minus, ema, bias, scale, coeff)) /
                        (2 * eps);
      EXPECT_NEAR(hand[t][i], fd, 1e-7) << "logit [" << t << "][" << i << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    MethodsAndPresets, LossGradientTest,
    ::testing::Combine(::testing::ValuesIn(testing::kAllMethods),
                       ::testing::Values("paper", "reference")),
    MethodPresetName);

}  // namespace
}  // namespace himoe::router
