// The paper's identities on random loads and random routers, and the batch
// statistics against hand computation.
#include <cmath>
#include <random>

#include <gtest/gtest.h>

#include "router_service/routing_math.h"
#include "tests/router_service/routing_test_util.h"

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

TEST(PaperIdentityTest, TheoremOneCertificateHoldsOnRandomRouters) {
  at::manual_seed(3);
  for (int trial = 0; trial < 60; ++trial) {
    const int m = 2 + trial % 4, s = 1 + trial % 5, k = 1 + trial % s;
    const RoutingMethod method = testing::kAllMethods[trial % 5];
    RoutingConfig c = Config(method, m * s, m, k);
    c.renormalize = trial % 2 == 0;
    auto router = MakeRouter(c);
    const double scale = 0.1 + (trial % 6);
    const RoutingOutput out =
        MustRoute(*router, at::randn({64, m * s}, at::kDouble) * scale, true);
    const at::Tensor sparse = SparseSelectedProbs(out.probs, out.expert_ids);
    const Theorem1Certificate cert = ComputeTheorem1Certificate(sparse, m);
    // CV_group^2 + 1 = M ||rbar||^2 for the soft group load sum_x r(x) ...
    const double cv = CoefficientOfVariation(cert.soft_group_load);
    EXPECT_NEAR(cv * cv + 1.0, cert.lhs, 1e-9) << "trial " << trial;
    // ... <= M S_max E||pi_tilde_normalized||^2.
    EXPECT_LE(cert.lhs, cert.rhs + 1e-12) << "trial " << trial;
    EXPECT_DOUBLE_EQ(out.stats.cert_lhs, cert.lhs);
    EXPECT_DOUBLE_EQ(out.stats.cert_rhs, cert.rhs);
  }
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
