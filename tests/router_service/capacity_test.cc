// Capacity: cap = ceil(cf*K*T/N), drops in priority order (spec "Capacity").
#include <gtest/gtest.h>

#include "router_service/routing_math.h"
#include "tests/router_service/routing_test_util.h"

namespace himoe::router {
namespace {

using testing::Config;
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

}  // namespace
}  // namespace himoe::router
