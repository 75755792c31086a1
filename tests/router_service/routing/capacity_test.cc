// Capacity: cap = ceil(cf*K*T/N), drops in priority order (spec "Capacity").
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "router_service/routing/routing_math.h"
#include "tests/router_service/routing/routing_test_util.h"

namespace himoe::router {
namespace {

using testing::Config;
using testing::Ids;
using testing::MakeRouter;
using testing::MustRoute;
using testing::ToNested;
using testing::ToTensor;

TEST(CapacityTest, CapacityFormula) {
  EXPECT_EQ(ExpertCapacity(1.0, 2, 5, 4), 3);   // ceil(2.5)
  EXPECT_EQ(ExpertCapacity(2.0, 4, 64, 8), 64);  // exact
  EXPECT_EQ(ExpertCapacity(1.25, 1, 10, 8), 2);  // ceil(1.5625)
  EXPECT_EQ(ExpertCapacity(0.0, 4, 64, 8), -1);  // dropless
}

TEST(CapacityTest, FirstChoicesOfAllTokensBeforeAnySecondChoice) {
  // Expert 0 is the 2nd choice of tokens 0 and 1 but the 1st choice of
  // token 2: with room for one, token 2 keeps it although it comes last.
  Selection sel;
  sel.ids = at::tensor({1, 0, 2, 0, 0, 3}, at::kLong).view({3, 2});
  sel.rank = at::tensor({0, 1, 0, 1, 0, 1}, at::kLong).view({3, 2});
  const at::Tensor kept = CapacityKeepMask(sel, 4, /*capacity=*/1);
  EXPECT_EQ(ToNested(kept), (std::vector<std::vector<int64_t>>{{1, 0}, {1, 0}, {1, 1}}));
  // Within one rank, earlier tokens win.
  sel.rank = at::zeros({3, 2}, at::kLong);
  EXPECT_EQ(ToNested(CapacityKeepMask(sel, 4, 1)),
            (std::vector<std::vector<int64_t>>{{1, 1}, {1, 0}, {0, 1}}));
}

TEST(CapacityTest, RouterDropsAndReportsDropRate) {
  // N=4, M=2, flat K=2, T=4, cf=0.5 -> cap = ceil(0.5*2*4/4) = 1.
  RoutingConfig c = Config(RoutingMethod::kVanilla, 4, 2, 1);
  c.capacity_factor = 0.5;
  auto router = MakeRouter(c);
  const RoutingOutput out = MustRoute(
      *router,
      ToTensor({{3, 2, 0, 0}, {3, 0, 2, 0}, {0, 3, 2, 0}, {3, 0, 0, 2}}), false);
  // Rank 0: tokens 0,1,3 want expert 0 (token 0 wins), token 2 takes 1.
  // Rank 1: token 0 -> 1 (full), token 1 -> 2 (kept), token 2 -> 2 (full),
  // token 3 -> 3 (kept).
  EXPECT_EQ(out.stats.capacity, 1);
  EXPECT_EQ(ToNested(out.kept),
            (std::vector<std::vector<int64_t>>{{1, 0}, {0, 1}, {1, 0}, {0, 1}}));
  EXPECT_EQ(out.stats.dropped, 4);
  EXPECT_DOUBLE_EQ(out.stats.drop_rate, 4.0 / 8.0);
  int64_t dispatched = 0;
  for (const GroupDispatch& d : out.groups) dispatched += d.token_rows.numel();
  EXPECT_EQ(dispatched, 4);
  // Counts (and CV) are of the routing decision, before drops.
  EXPECT_EQ(out.stats.expert_counts, (std::vector<double>{3, 2, 2, 1}));
}

// Scores that put expert ids[t][j] at position j: the first gets 10, the
// next 9, ...; every expert not listed gets -1 - its index (no ties).
at::Tensor LogitsRanking(const Ids& order, int n) {
  testing::Matrix m;
  for (const auto& row : order) {
    std::vector<double> z(n);
    for (int i = 0; i < n; ++i) z[i] = -1.0 - i;
    for (size_t j = 0; j < row.size(); ++j) z[row[j]] = 10.0 - static_cast<double>(j);
    m.push_back(z);
  }
  return ToTensor(m);
}

TEST(CapacityTest, GroupedTwoPerGroupSecondChoicesWaitForAllFirstChoices) {
  // moge, N=6 in M=2 groups ({0,1,2}, {3,4,5}), k=2 per group, K=4, T=3,
  // cf=0.5 -> cap = ceil(0.5*4*3/6) = 1. The picks, best first per group:
  //   token 0: {1, 0 | 3, 4}   token 1: {0, 2 | 4, 5}   token 2: {2, 1 | 5, 3}
  // Each expert is one token's first choice and another's second choice.
  // First choices first: every token keeps exactly its two first choices.
  //   kept = {1,0,1,0} for all three tokens.
  // Token order instead would give token 0 all four, token 1 {0,1,0,1},
  // token 2 nothing; ranks laid out by group ({0,0,1,1}) give the same.
  RoutingConfig c = Config(RoutingMethod::kMoge, 6, 2, 2);
  c.capacity_factor = 0.5;
  auto router = MakeRouter(c);
  const Ids picks = {{1, 0, 3, 4}, {0, 2, 4, 5}, {2, 1, 5, 3}};
  const RoutingOutput out = MustRoute(*router, LogitsRanking(picks, 6), false);
  ASSERT_EQ(ToNested(out.expert_ids), picks);
  EXPECT_EQ(out.stats.capacity, 1);
  EXPECT_EQ(ToNested(out.kept), (Ids{{1, 0, 1, 0}, {1, 0, 1, 0}, {1, 0, 1, 0}}));
  EXPECT_EQ(out.stats.dropped, 6);
  EXPECT_DOUBLE_EQ(out.stats.drop_rate, 6.0 / 12.0);
}

TEST(CapacityTest, GroupedTwoPerGroupRanksRestartInEveryGroup) {
  // himoe (tau = 0, so pi = p), N=8 in M=2 groups ({0..3}, {4..7}), k=2,
  // K=4, T=4, cf=0.75 -> cap = ceil(0.75*4*4/8) = 2.
  //   token 0: {0, 1 | 4, 5}
  //   token 1: {1, 0 | 5, 4}
  //   token 2: {2, 0 | 4, 6}
  //   token 3: {3, 1 | 7, 4}
  // Rank 0 (each group's first choice), by token: 0->0, 1->4 | 1->1, 1->5 |
  //   2->2, 2->4 (expert 4: 2nd) | 3->3, 3->7. All kept.
  // Rank 1: t0: 1 (2nd, kept), 5 (2nd, kept) | t1: 0 (2nd, kept), 4 (full) |
  //   t2: 0 (full), 6 (kept) | t3: 1 (full), 4 (full).
  // Token order would instead keep all of token 1's picks (its second choice
  // 4 included) and drop token 2's FIRST choice 4.
  RoutingConfig c = Config(RoutingMethod::kHiMoe, 8, 2, 2);
  c.tau = 0.0;
  c.capacity_factor = 0.75;
  auto router = MakeRouter(c);
  const Ids picks = {{0, 1, 4, 5}, {1, 0, 5, 4}, {2, 0, 4, 6}, {3, 1, 7, 4}};
  const RoutingOutput out = MustRoute(*router, LogitsRanking(picks, 8), false);
  ASSERT_EQ(ToNested(out.expert_ids), picks);
  EXPECT_EQ(out.stats.capacity, 2);
  EXPECT_EQ(ToNested(out.kept),
            (Ids{{1, 1, 1, 1}, {1, 1, 1, 0}, {1, 0, 1, 1}, {1, 0, 1, 0}}));
  EXPECT_EQ(out.stats.dropped, 4);
}

TEST(CapacityTest, FlatThreeChoicesByRankThenToken) {
  // vanilla, N=6, M=3, k=1 -> flat K=3, T=3, cf=0.5 -> cap = ceil(0.75) = 1.
  //   token 0: {0, 1, 2}   token 1: {1, 3, 0}   token 2: {3, 2, 4}
  // Rank 0: 0 (t0), 1 (t1), 3 (t2) kept. Rank 1: t0's 1 full, t1's 3 full,
  // t2's 2 kept. Rank 2: t0's 2 full, t1's 0 full, t2's 4 kept.
  // Token order would give {1,1,1}, {0,1,0}, {0,0,1}.
  RoutingConfig c = Config(RoutingMethod::kVanilla, 6, 3, 1);
  c.capacity_factor = 0.5;
  auto router = MakeRouter(c);
  const Ids picks = {{0, 1, 2}, {1, 3, 0}, {3, 2, 4}};
  const RoutingOutput out = MustRoute(*router, LogitsRanking(picks, 6), false);
  ASSERT_EQ(ToNested(out.expert_ids), picks);
  EXPECT_EQ(out.stats.capacity, 1);
  EXPECT_EQ(ToNested(out.kept), (Ids{{1, 0, 0}, {1, 0, 0}, {1, 1, 1}}));
  EXPECT_EQ(out.stats.dropped, 4);
}

TEST(CapacityTest, RandomBatchesMatchTheHandDropRule) {
  // Against the oracle's selection and its sorted-list drop rule.
  at::manual_seed(29);
  struct Shape {
    RoutingMethod method;
    int n, m, k;
  };
  const Shape shapes[] = {{RoutingMethod::kMoge, 8, 2, 2},    {RoutingMethod::kHiMoe, 12, 3, 3},
                          {RoutingMethod::kMoge, 16, 4, 2},   {RoutingMethod::kVanilla, 8, 2, 1},
                          {RoutingMethod::kVanilla, 8, 4, 1}, {RoutingMethod::kStMoe, 12, 3, 2}};
  int64_t total_dropped = 0;
  for (const Shape& sh : shapes) {
    for (double cf : {0.3, 0.6, 1.0, 1.5}) {
      RoutingConfig c = Config(sh.method, sh.n, sh.m, sh.k);
      c.capacity_factor = cf;
      c.tau = 0.0;
      auto router = MakeRouter(c);
      const int64_t tokens = 20;
      const at::Tensor logits = at::randn({tokens, sh.n}, at::kDouble) * 2;
      const RoutingOutput out = MustRoute(*router, logits, false);
      const testing::HandRoute want = testing::HandRouting(
          c, testing::ToMatrix(logits), std::vector<double>(sh.n, 0.0));
      const std::string what =
          std::string(RoutingMethodName(sh.method)) + " cf=" + std::to_string(cf);
      ASSERT_EQ(ToNested(out.expert_ids), want.ids) << what;
      const int64_t cap = testing::HandCapacity(cf, c.total_k(), tokens, sh.n);
      EXPECT_EQ(out.stats.capacity, cap) << what;
      const Ids kept = testing::HandKeepMask(want.ids, want.rank, sh.n, cap);
      EXPECT_EQ(ToNested(out.kept), kept) << what;
      int64_t dropped = 0;
      for (const auto& row : kept) {
        for (int64_t v : row) dropped += 1 - v;
      }
      EXPECT_EQ(out.stats.dropped, dropped) << what;
      total_dropped += dropped;
    }
  }
  EXPECT_GT(total_dropped, 0);
}

TEST(CapacityTest, GroupedRanksAreWithinGroup) {
  // himoe, k=1: every pick is a first choice within its group, so with cap 2
  // the two earliest tokens keep expert 0 and 2, the third is dropped.
  RoutingConfig c = Config(RoutingMethod::kMoge, 4, 2, 1);
  c.capacity_factor = 1.0;  // cap = ceil(1*2*3/4) = 2
  auto router = MakeRouter(c);
  const RoutingOutput out =
      MustRoute(*router, ToTensor({{3, 0, 3, 0}, {3, 0, 3, 0}, {3, 0, 3, 0}}), false);
  EXPECT_EQ(ToNested(out.kept),
            (std::vector<std::vector<int64_t>>{{1, 1}, {1, 1}, {0, 0}}));
  EXPECT_DOUBLE_EQ(out.stats.drop_rate, 2.0 / 6.0);
}

// Serving merges concurrent requests into one batch. Routed with their
// segments, each request's picks, drops and dispatch equal those of the
// request routed alone, for capacity and for st_moe's random second-choice
// drop; without them the merged batch's drops differ (the coupling a
// caller would see).
TEST(CapacityTest, SegmentsAreEachRoutedAsIfAlone) {
  const std::vector<int64_t> rows = {5, 11, 2, 7};
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor logits = at::randn({25, 8}, gen, at::dtype(at::kDouble)) * 2;
  for (const RoutingMethod method :
       {RoutingMethod::kHiMoe, RoutingMethod::kVanilla, RoutingMethod::kStMoe}) {
    SCOPED_TRACE(std::string(RoutingMethodName(method)));
    RoutingConfig c = Config(method, 8, 4, 1);
    c.capacity_factor = 0.5;
    if (method == RoutingMethod::kStMoe) c.second_choice_threshold = 0.2;
    auto router = MakeRouter(c);  // seed 1
    // The oracle: the hand selection, then each segment's own capacity
    // (HandCapacity of its rows) and, for st_moe, its own draws from the
    // evaluation seed (call 0), kept by the hand drop rule.
    const testing::HandRoute want =
        testing::HandRouting(c, testing::ToMatrix(logits), std::vector<double>(8, 0.0));
    ASSERT_GT(testing::HandSelectionMargin(c, want), 1e-9);
    const uint64_t drop_seed = testing::HandDropSeed(1, 0);
    const Ids want_kept = testing::HandKeep(c, want, drop_seed, rows);
    const int64_t want_dropped = testing::CountDropped(want_kept);
    int64_t offset = 0;
    for (const int64_t n : rows) {
      const RoutingOutput alone = MustRoute(*router, logits.narrow(0, offset, n), false);
      const Ids part(want_kept.begin() + offset, want_kept.begin() + offset + n);
      EXPECT_EQ(ToNested(alone.kept), part) << "segment at row " << offset;
      EXPECT_EQ(alone.stats.capacity, testing::HandCapacity(c, n));
      offset += n;
    }
    auto merged = router->RouteLogits(logits, false, rows);
    ASSERT_TRUE(merged.ok()) << merged.status();
    EXPECT_EQ(ToNested(merged->expert_ids), want.ids);
    EXPECT_EQ(ToNested(merged->kept), want_kept);
    const auto weights = ToNested<double>(merged->weights);
    for (size_t t = 0; t < want.weights.size(); ++t) {
      for (size_t j = 0; j < want.weights[t].size(); ++j) {
        EXPECT_NEAR(weights[t][j], want.weights[t][j], 1e-12) << t << ", " << j;
      }
    }
    // The dispatch carries exactly the hand-kept assignments.
    int64_t dispatched = 0;
    for (const GroupDispatch& d : merged->groups) dispatched += d.token_rows.numel();
    EXPECT_EQ(dispatched, 25 * c.total_k() - want_dropped);
    EXPECT_EQ(merged->stats.dropped, want_dropped);
    EXPECT_GT(want_dropped, 0);
    // Routed whole, the batch has one capacity (and one stream of draws):
    // other drops.
    const Ids whole = testing::HandKeep(c, want, drop_seed);
    ASSERT_NE(whole, want_kept);
    EXPECT_EQ(ToNested(MustRoute(*router, logits, false).kept), whole);
  }
  RoutingConfig c = Config(RoutingMethod::kHiMoe, 8, 4, 1);
  auto router = MakeRouter(c);
  const at::Tensor six = at::randn({6, 8}, gen, at::dtype(at::kDouble));
  EXPECT_EQ(router->RouteLogits(six, false, {2, 3}).status().code(),
            absl::StatusCode::kInvalidArgument);  // 5 of 6 rows
  EXPECT_EQ(router->RouteLogits(six, false, {6, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace himoe::router
