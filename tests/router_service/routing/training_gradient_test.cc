// Gradients in TRAINING mode (spec "Bias correction", "Losses"): the EMA is
// updated with this batch before pi uses it, it carries no gradient, and the
// gradient flows through pi (and p) into the logits and on into W_g.
//
// The reference is the plain-double oracle of routing_test_util.h
// (testing::HandRouting), differentiated by central finite differences with
// the EMA held at its hand-computed post-update value. The oracle never reads
// a RoutingOutput, so a wrong selection, a wrong EMA, an EMA updated after
// use, or a gradient that does not reach pi all show up as mismatches.
#include <cmath>
#include <string>
#include <tuple>

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "router_service/routing/routing_math.h"
#include "tests/router_service/routing/routing_test_util.h"

namespace himoe::router {
namespace {

using testing::Config;
using testing::HandRoute;
using testing::HandRouting;
using testing::Matrix;
using testing::MakeRouter;
using testing::MustRoute;
using testing::ToMatrix;
using testing::ToTensor;
using testing::ToVector;

using testing::MethodPreset;
using testing::MethodPresetName;

// Large coefficients so that every term moves the gradient visibly, and a
// strong correction with a fast EMA so that the update-before-use matters.
RoutingConfig StrongConfig(const MethodPreset& param) {
  RoutingConfig c = Config(std::get<0>(param), 8, 4, 1);
  EXPECT_TRUE(ApplyPreset(std::get<1>(param), &c).ok());
  c.tau = 0.3;
  c.temperature = 0.7;
  c.ema_beta = 0.8;
  c.alpha = 0.5;
  c.lambda_intra = 0.7;
  c.lambda_inter = 0.9;
  c.z_coef = 0.2;
  return c;
}

// aux losses + sum(weights * coeff), by the oracle, with gbar fixed.
double HandObjective(const RoutingConfig& c, const Matrix& logits, const std::vector<double>& ema,
                     const std::vector<double>& bias, const Matrix& coeff) {
  const HandRoute r = HandRouting(c, logits, ema, bias);
  double f = r.AuxTotal();
  for (size_t t = 0; t < r.weights.size(); ++t) {
    for (size_t j = 0; j < r.weights[t].size(); ++j) f += r.weights[t][j] * coeff[t][j];
  }
  return f;
}

class TrainingLogitGradientTest : public ::testing::TestWithParam<MethodPreset> {};

TEST_P(TrainingLogitGradientTest, AutogradMatchesFiniteDifferencesOfTheOracle) {
  at::manual_seed(11);
  const RoutingConfig c = StrongConfig(GetParam());
  const bool himoe = c.method == RoutingMethod::kHiMoe;
  auto router = MakeRouter(c);
  const at::Tensor ema0 = at::randn({8}) * 2;
  router->logit_ema().copy_(ema0);
  std::vector<double> bias;
  if (c.method == RoutingMethod::kLossFree) {
    router->loss_free_bias().copy_(at::randn({8}) * 0.05);
    bias = ToVector(router->loss_free_bias());
  }
  const int64_t tokens = 6;
  const at::Tensor logits = at::randn({tokens, 8}, at::kDouble) * 1.5;
  const Matrix g = ToMatrix(logits);
  const Matrix coeff = ToMatrix(at::randn({tokens, c.total_k()}, at::kDouble));

  const at::Tensor input = logits.clone().set_requires_grad(true);
  const RoutingOutput out = MustRoute(*router, input, /*training=*/true);
  const at::Tensor f = out.losses.Total() + (out.weights * ToTensor(coeff)).sum();
  const at::Tensor grad = torch::autograd::grad({f}, {input})[0];
  ASSERT_TRUE(grad.defined());

  // gbar after the call: updated with this batch (himoe), untouched otherwise.
  const std::vector<double> ema1 =
      himoe ? testing::HandEmaUpdate(ToVector(ema0), g, c.ema_beta) : ToVector(ema0);
  const std::vector<double> ema_after = ToVector(router->logit_ema());
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(ema_after[i], ema1[i], 1e-6) << "gbar[" << i << "]";
  if (himoe) {
    // The update is large enough to matter (so update-after-use would show).
    double moved = 0;
    for (int i = 0; i < 8; ++i) moved = std::max(moved, std::abs(ema1[i] - ema0[i].item<double>()));
    ASSERT_GT(c.tau * moved / c.temperature, 0.05);
  }

  const HandRoute want = HandRouting(c, g, ema1, bias);
  ASSERT_GT(testing::HandSelectionMargin(c, want), 1e-4);
  EXPECT_EQ(testing::ToNested(out.expert_ids), want.ids);
  EXPECT_NEAR(f.item<double>(), HandObjective(c, g, ema1, bias, coeff), 1e-7);

  const double eps = 1e-6;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < 8; ++i) {
      Matrix plus = g, minus = g;
      plus[t][i] += eps;
      minus[t][i] -= eps;
      const double fd = (HandObjective(c, plus, ema1, bias, coeff) -
                         HandObjective(c, minus, ema1, bias, coeff)) / (2 * eps);
      EXPECT_NEAR(grad[t][i].item<double>(), fd, 1e-6) << "logit [" << t << "][" << i << "]";
    }
  }
  EXPECT_GT(grad.abs().sum().item<double>(), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    MethodsAndPresets, TrainingLogitGradientTest,
    ::testing::Combine(::testing::ValuesIn(testing::kAllMethods),
                       ::testing::Values("paper", "reference")),
    MethodPresetName);

// d(total aux loss)/d(W_g) through Route(x) in training mode, against central
// differences on W_g of the oracle in double precision (logits x W_g^T by
// loops, gbar held at its post-update value). Route(x) computes the logits in
// fp32 (RouterLogits), so the code's gradient is an fp32 one: the tolerance
// is relative, 1e-4, far below the size of any wrong path.
class GateGradientTest : public ::testing::TestWithParam<MethodPreset> {};

TEST_P(GateGradientTest, AuxLossGradientReachesGateWeightsThroughRoute) {
  at::manual_seed(23);
  const RoutingConfig c = StrongConfig(GetParam());
  const bool himoe = c.method == RoutingMethod::kHiMoe;
  constexpr int64_t kD = 4, kT = 6, kN = 8;
  auto router = MakeRouter(c, kD);
  const at::Tensor w0 = at::randn({kN, kD}) * 0.8;
  router->gate_weight() = w0.clone().set_requires_grad(true);
  const at::Tensor ema0 = at::randn({kN}) * 2;
  router->logit_ema().copy_(ema0);
  const at::Tensor x = at::randn({kT, kD});

  auto out = router->Route(x, /*training=*/true);
  ASSERT_TRUE(out.ok()) << out.status();
  const at::Tensor aux = out->losses.Total();
  ASSERT_TRUE(aux.requires_grad()) << "the aux losses do not depend on W_g";
  const at::Tensor grad = torch::autograd::grad({aux}, {router->gate_weight()})[0];
  ASSERT_TRUE(grad.defined());

  const Matrix xm = ToMatrix(x), w = ToMatrix(w0);
  const auto logits_of = [&](const Matrix& gate) {
    Matrix g(kT, std::vector<double>(kN, 0.0));
    for (int64_t t = 0; t < kT; ++t) {
      for (int64_t i = 0; i < kN; ++i) {
        for (int64_t d = 0; d < kD; ++d) g[t][i] += xm[t][d] * gate[i][d];
      }
    }
    return g;
  };
  const Matrix g = logits_of(w);
  const std::vector<double> ema1 =
      himoe ? testing::HandEmaUpdate(ToVector(ema0), g, c.ema_beta) : ToVector(ema0);
  const std::vector<double> ema_after = ToVector(router->logit_ema());
  for (int i = 0; i < kN; ++i) EXPECT_NEAR(ema_after[i], ema1[i], 1e-5) << "gbar[" << i << "]";

  const HandRoute want = HandRouting(c, g, ema1);
  ASSERT_GT(testing::HandSelectionMargin(c, want), 1e-5);  // fp32 logits: ~1e-7 off
  EXPECT_EQ(testing::ToNested(out->expert_ids), want.ids);
  EXPECT_NEAR(aux.item<double>(), want.AuxTotal(), 1e-5 * std::max(1.0, std::abs(want.AuxTotal())));

  const double eps = 1e-6;
  double max_fd = 0;
  for (int64_t i = 0; i < kN; ++i) {
    for (int64_t d = 0; d < kD; ++d) {
      Matrix plus = w, minus = w;
      plus[i][d] += eps;
      minus[i][d] -= eps;
      const double fd = (HandRouting(c, logits_of(plus), ema1).AuxTotal() -
                         HandRouting(c, logits_of(minus), ema1).AuxTotal()) / (2 * eps);
      max_fd = std::max(max_fd, std::abs(fd));
      EXPECT_NEAR(grad[i][d].item<double>(), fd, 1e-5 + 1e-4 * std::abs(fd))
          << "dL_aux/dW_g[" << i << "][" << d << "]";
    }
  }
  EXPECT_GT(max_fd, 1e-2);  // the comparison is not between two zeros
}

INSTANTIATE_TEST_SUITE_P(
    MethodsAndPresets, GateGradientTest,
    ::testing::Combine(::testing::Values(RoutingMethod::kVanilla, RoutingMethod::kStMoe,
                                         RoutingMethod::kMoge, RoutingMethod::kHiMoe),
                       ::testing::Values("paper", "reference")),
    MethodPresetName);

}  // namespace
}  // namespace himoe::router
