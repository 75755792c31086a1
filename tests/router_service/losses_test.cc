// Loss values against hand-computed formulas, and loss gradients against
// finite differences in double precision (spec "Losses").
#include <cmath>

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "router_service/routing_math.h"
#include "tests/router_service/routing_test_util.h"

namespace himoe::router {
namespace {

using testing::Config;
using testing::Matrix;
using testing::MakeRouter;
using testing::MustRoute;
using testing::Softmax;
using testing::ToNested;
using testing::ToTensor;

struct Losses {
  double load = 0, intra = 0, inter = 0, z = 0;
};

// The spec's loss formulas in plain doubles, given the selection.
Losses HandLosses(const RoutingConfig& c, const Matrix& g, const std::vector<double>& ema,
                  const std::vector<std::vector<int64_t>>& ids) {
  const size_t tokens = g.size(), n = g[0].size(), s = n / c.num_groups;
  const bool himoe = c.method == RoutingMethod::kHiMoe;
  Matrix p, pi;
  for (const auto& row : g) {
    p.push_back(Softmax(row));
    std::vector<double> z;
    for (size_t i = 0; i < n; ++i) z.push_back((row[i] - c.tau * ema[i]) / c.temperature);
    pi.push_back(himoe ? Softmax(z) : p.back());
  }
  Losses l;
  std::vector<double> h(n, 0.0), big_p(n, 0.0);
  for (size_t t = 0; t < tokens; ++t) {
    for (int64_t id : ids[t]) h[id] += 1.0 / tokens;
    const auto& src = c.load_source == ProbSource::kCorrected ? pi[t] : p[t];
    for (size_t i = 0; i < n; ++i) big_p[i] += src[i] / tokens;
  }
  if (c.method != RoutingMethod::kLossFree) {
    for (size_t i = 0; i < n; ++i) l.load += c.alpha * n * h[i] * big_p[i];
  }
  for (size_t t = 0; t < tokens; ++t) {
    if (himoe) {
      const auto& src = c.intra_source == ProbSource::kCorrected ? pi[t] : p[t];
      for (double v : src) l.intra -= c.lambda_intra * v * v / tokens;
      if (c.inter_form == InterForm::kSelectedWeights) {
        for (int64_t id : ids[t]) l.inter += c.lambda_inter * pi[t][id] * pi[t][id] / tokens;
      } else {
        for (int gi = 0; gi < c.num_groups; ++gi) {
          double mass = 0;
          for (size_t i = gi * s; i < (gi + 1) * s; ++i) mass += p[t][i];
          l.inter += c.lambda_inter * mass * mass / tokens;
        }
      }
    }
    if (c.method == RoutingMethod::kStMoe) {
      double sum = 0;
      for (double v : g[t]) sum += std::exp(v);
      l.z += c.z_coef * std::log(sum) * std::log(sum) / tokens;
    }
  }
  return l;
}

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
  ASSERT_TRUE(ApplyPreset(std::get<1>(GetParam()), &c).ok());
  c.capacity_factor = 0;
  c.tau = 0.5;  // strong correction, so pi != p and the switches matter
  c.ema_beta = 0.5;
  c.temperature = 0.8;
  auto router = MakeRouter(c);
  const RoutingOutput out = MustRoute(*router, ToTensor(kLogits), /*training=*/true);
  std::vector<double> ema(8, 0.0);  // first training step: gbar = (1-beta) mean g
  for (const auto& row : kLogits) {
    for (int i = 0; i < 8; ++i) ema[i] += 0.5 * row[i] / kLogits.size();
  }
  const Losses want = HandLosses(c, kLogits, ema, ToNested(out.expert_ids));
  const double tol = 1e-9;  // the EMA buffer is stored in fp32
  EXPECT_NEAR(out.losses.load.item<double>(), want.load, tol);
  EXPECT_NEAR(out.losses.intra.item<double>(), want.intra, tol);
  EXPECT_NEAR(out.losses.inter.item<double>(), want.inter, tol);
  EXPECT_NEAR(out.losses.z.item<double>(), want.z, tol);
  EXPECT_NEAR(out.losses.Total().item<double>(),
              want.load + want.intra + want.inter + want.z, tol);
  // Each method uses exactly its terms.
  const RoutingMethod m = c.method;
  EXPECT_EQ(want.load != 0, m != RoutingMethod::kLossFree);
  EXPECT_EQ(want.intra != 0 && want.inter != 0, m == RoutingMethod::kHiMoe);
  EXPECT_EQ(want.z != 0, m == RoutingMethod::kStMoe);
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
  ASSERT_TRUE(ApplyPreset(std::get<1>(GetParam()), &c).ok());
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
