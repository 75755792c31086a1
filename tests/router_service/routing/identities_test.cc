// The paper's identities on random loads and random routers, and the batch
// statistics against hand computation.
#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "router_service/routing/routing_math.h"
#include "tests/router_service/routing/routing_test_util.h"

namespace himoe::router {
namespace {

using testing::Config;
using testing::MakeRouter;
using testing::MustRoute;
using testing::ToTensor;

TEST(PaperIdentityTest, PropositionOneCvSquaredEqualsMNormMinusOne) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int m = 2 + trial % 15;
    std::vector<double> load(m);
    std::exponential_distribution<double> dist(1.0 / (1 + trial % 7));
    for (double& l : load) l = (trial % 5 == 0 && &l == &load[0]) ? 0.0 : dist(rng);
    double total = 0, norm2 = 0;
    for (double l : load) total += l;
    for (double l : load) norm2 += (l / total) * (l / total);
    const double cv = CoefficientOfVariation(load);
    EXPECT_NEAR(cv * cv, m * norm2 - 1.0, 1e-10) << "trial " << trial;
  }
}

// The certificate by loops from the oracle's pi and selection:
//   pi_hat(x) = pi_tilde(x) / sum pi_tilde(x), r_g(x) = sum_{i in g} pi_hat_i,
//   lhs = CV(sum_x r(x))^2 + 1 (population CV, the Proposition's side),
//   also M*||rbar||^2 (the Theorem's side), rhs = M*S*mean ||pi_hat||^2.
struct HandCertificate {
  double lhs_cv = 0, lhs_norm = 0, rhs = 0;
  std::vector<double> soft_group_load;
};

HandCertificate HandTheorem1(const testing::HandRoute& r, int m) {
  const size_t tokens = r.pi.size(), n = r.pi[0].size(), s = n / m;
  HandCertificate c;
  c.soft_group_load.assign(m, 0.0);
  double hat_sq = 0;
  for (size_t t = 0; t < tokens; ++t) {
    std::vector<double> tilde(n, 0.0);
    for (int64_t id : r.ids[t]) tilde[id] = r.pi[t][id];
    double sum = 0;
    for (double v : tilde) sum += v;
    for (size_t i = 0; i < n; ++i) {
      const double hat = tilde[i] / sum;
      c.soft_group_load[i / s] += hat;
      hat_sq += hat * hat / tokens;
    }
  }
  double mean = 0, var = 0, rbar_sq = 0;
  for (double l : c.soft_group_load) mean += l / m;
  for (double l : c.soft_group_load) var += (l - mean) * (l - mean) / m;
  for (double l : c.soft_group_load) rbar_sq += (l / tokens) * (l / tokens);
  c.lhs_cv = var / (mean * mean) + 1.0;
  c.lhs_norm = m * rbar_sq;
  c.rhs = m * static_cast<double>(s) * hat_sq;
  return c;
}

TEST(PaperIdentityTest, TheoremOneCertificateHoldsOnRandomRouters) {
  at::manual_seed(3);
  int strict = 0, near_ties = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int m = 2 + trial % 4, s = 1 + trial % 5, k = 1 + trial % s;
    const RoutingMethod method = testing::kAllMethods[trial % 5];
    RoutingConfig c = Config(method, m * s, m, k);
    c.renormalize = trial % 2 == 0;
    c.tau = 0.5;  // himoe: pi visibly differs from p
    auto router = MakeRouter(c);
    const double scale = 0.1 + (trial % 6);
    const at::Tensor logits = at::randn({64, m * s}, at::kDouble) * scale;
    const RoutingOutput out = MustRoute(*router, logits, true);
    // The oracle's pi (first training step: gbar = (1-beta) mean g) and ids.
    const testing::Matrix g = testing::ToMatrix(logits);
    const std::vector<double> ema =
        testing::HandEmaUpdate(std::vector<double>(m * s, 0.0), g, c.ema_beta);
    const testing::HandRoute want = testing::HandRouting(c, g, ema);
    // pi goes through the fp32 EMA buffer (~1e-8 off): skip near-ties.
    if (testing::HandSelectionMargin(c, want) < 1e-6) {
      ++near_ties;
      continue;
    }
    ASSERT_EQ(testing::ToNested(out.expert_ids), want.ids) << "trial " << trial;
    const HandCertificate hand = HandTheorem1(want, m);
    const double tol = 1e-7;  // the EMA buffer is fp32
    // The exported statistics against the loops.
    EXPECT_NEAR(out.stats.cert_lhs, hand.lhs_norm, tol) << "trial " << trial;
    EXPECT_NEAR(out.stats.cert_lhs, hand.lhs_cv, tol) << "trial " << trial;
    EXPECT_NEAR(out.stats.cert_rhs, hand.rhs, tol) << "trial " << trial;
    EXPECT_LE(out.stats.cert_lhs, out.stats.cert_rhs + 1e-12) << "trial " << trial;
    // The function itself, on a pi_tilde built by hand (no code selection).
    at::Tensor sparse = at::zeros({64, m * s}, at::kDouble);
    for (int64_t t = 0; t < 64; ++t) {
      for (int64_t id : want.ids[t]) sparse[t][id] = want.pi[t][id];
    }
    const Theorem1Certificate cert = ComputeTheorem1Certificate(sparse, m);
    EXPECT_NEAR(cert.lhs, hand.lhs_cv, 1e-10) << "trial " << trial;
    EXPECT_NEAR(cert.rhs, hand.rhs, 1e-10) << "trial " << trial;
    ASSERT_EQ(cert.soft_group_load.size(), static_cast<size_t>(m));
    for (int gi = 0; gi < m; ++gi) {
      EXPECT_NEAR(cert.soft_group_load[gi], hand.soft_group_load[gi], 1e-10);
    }
    EXPECT_LE(cert.lhs, cert.rhs + 1e-12) << "trial " << trial;
    if (hand.rhs - hand.lhs_cv > 0.05) ++strict;
  }
  EXPECT_LT(near_ties, 6);
  EXPECT_GT(strict, 10);  // the inequality is not trivially an equality here
}

TEST(PaperIdentityTest, OverlapEqualsOneMinusSquaredNorm) {
  at::manual_seed(5);
  const at::Tensor pi = at::softmax(at::randn({50, 12}, at::kDouble) * 2, 1);
  const at::Tensor overlap = RoutingOverlap(pi);
  for (int64_t t = 0; t < 50; ++t) {
    double cross = 0;
    for (int64_t i = 0; i < 12; ++i) {
      for (int64_t j = 0; j < 12; ++j) {
        if (i != j) cross += pi[t][i].item<double>() * pi[t][j].item<double>();
      }
    }
    EXPECT_NEAR(overlap[t].item<double>(), cross, 1e-12);
  }
}

TEST(StatsTest, HandComputedBatchStatistics) {
  // N=4, M=2, flat top-2: token 0 -> {0, 1}, token 1 -> {1, 3}.
  auto router = MakeRouter(Config(RoutingMethod::kVanilla, 4, 2, 1));
  const RoutingOutput out =
      MustRoute(*router, ToTensor({{2.0, 1.0, 0.5, 0.0}, {0.0, 3.0, 1.0, 2.0}}), false);
  const RoutingStats& s = out.stats;
  EXPECT_EQ(s.tokens, 2);
  EXPECT_EQ(s.expert_counts, (std::vector<double>{1, 2, 0, 1}));
  EXPECT_EQ(s.group_counts, (std::vector<double>{3, 1}));
  // counts {1,2,0,1}: mean 1, population std sqrt(0.5).
  EXPECT_NEAR(s.expert_cv, std::sqrt(0.5), 1e-12);
  EXPECT_NEAR(s.group_cv, 0.5, 1e-12);  // {3,1}: mean 2, std 1
  EXPECT_NEAR(s.max_vio, 1.0, 1e-12);   // (2 - 1) / 1
  EXPECT_NEAR(s.groups_per_token, 1.5, 1e-12);
  const auto p0 = testing::Softmax({2.0, 1.0, 0.5, 0.0});
  const auto p1 = testing::Softmax({0.0, 3.0, 1.0, 2.0});
  double norm0 = 0, norm1 = 0;
  for (int i = 0; i < 4; ++i) norm0 += p0[i] * p0[i], norm1 += p1[i] * p1[i];
  EXPECT_NEAR(s.c_ov, 1.0 - (norm0 + norm1) / 2, 1e-12);
  EXPECT_NEAR(s.c_sys,
              (p0[0] * p0[0] + p0[1] * p0[1] + p1[1] * p1[1] + p1[3] * p1[3]) / 2, 1e-12);
  EXPECT_NEAR(s.collision_mi, std::log(4 * (norm0 + norm1) / 2), 1e-12);
  EXPECT_NEAR(s.soft_group_load[0], p0[0] + p0[1] + p1[0] + p1[1], 1e-12);
  EXPECT_EQ(s.dropped, 0);
  EXPECT_EQ(s.capacity, -1);
}

TEST(StatsTest, CvAndMaxVioEdgeCases) {
  EXPECT_EQ(CoefficientOfVariation({0, 0, 0}), 0.0);
  EXPECT_EQ(CoefficientOfVariation({5, 5, 5, 5}), 0.0);
  EXPECT_NEAR(CoefficientOfVariation({4, 0, 0, 0}), std::sqrt(3.0), 1e-12);
  EXPECT_NEAR(MaxViolation({4, 0, 0, 0}), 3.0, 1e-12);
}

}  // namespace
}  // namespace himoe::router
