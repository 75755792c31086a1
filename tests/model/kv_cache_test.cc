#include "model/kv_cache.h"

#include <utility>

#include <ATen/ATen.h>

#include "gtest/gtest.h"

namespace himoe::model {
namespace {

TEST(KvCachePoolTest, SlotsAreReusedLowestFirstAndGivenBackByTheCache) {
  KvCachePool pool(/*num_blocks=*/2, /*max_rows=*/16, /*d_model=*/4);
  KvCache a = pool.Acquire(), b = pool.Acquire(), c = pool.Acquire();
  EXPECT_EQ(a.slot(), 0);
  EXPECT_EQ(b.slot(), 1);
  EXPECT_EQ(c.slot(), 2);
  EXPECT_EQ(pool.slots_in_use(), 3);
  c = KvCache();
  a = KvCache();
  EXPECT_EQ(pool.slots_in_use(), 1);
  EXPECT_EQ(pool.Acquire().slot(), 0);  // the temporary gives it back at once
  KvCache d = pool.Acquire();
  EXPECT_EQ(d.slot(), 0);
  KvCache moved = std::move(d);
  EXPECT_EQ(d.pool(), nullptr);
  EXPECT_EQ(moved.slot(), 0);
  EXPECT_EQ(moved.pool(), &pool);
  EXPECT_EQ(pool.Acquire().slot(), 2);
  EXPECT_EQ(pool.slots_in_use(), 2);  // b and moved
}

TEST(KvCachePoolTest, ReserveGrowsZeroFilledAndKeepsWhatItHolds) {
  KvCachePool pool(/*num_blocks=*/2, /*max_rows=*/10, /*d_model=*/3);
  const auto options = at::TensorOptions().dtype(at::kFloat);
  pool.Reserve(1, 2, options);
  ASSERT_TRUE(pool.keys(1).defined());
  EXPECT_EQ(pool.keys(1).sizes(), (std::vector<int64_t>{1, 2, 3}));
  pool.keys(1).fill_(7);
  pool.values(0).fill_(-1);
  pool.Reserve(3, 3, options);  // doubling: 2 slots would do for 1, 3 asked
  EXPECT_EQ(pool.keys(1).sizes(), (std::vector<int64_t>{3, 4, 3}));
  EXPECT_EQ(pool.values(0).sizes(), (std::vector<int64_t>{3, 4, 3}));
  EXPECT_EQ(pool.keys(1).narrow(0, 0, 1).narrow(1, 0, 2).sum().item<float>(), 7 * 6);
  EXPECT_EQ(pool.keys(1).sum().item<float>(), 7 * 6);  // the new part is zero
  EXPECT_EQ(pool.values(0).sum().item<float>(), -6);
  pool.Reserve(2, 9, options);  // rows: doubling 4 -> 8 is short of 9
  EXPECT_EQ(pool.keys(0).sizes(), (std::vector<int64_t>{3, 9, 3}));
  pool.Reserve(3, 40, options);  // capped at max_rows
  EXPECT_EQ(pool.keys(0).sizes(), (std::vector<int64_t>{3, 10, 3}));
  EXPECT_EQ(pool.keys(1).sum().item<float>(), 7 * 6);
}

}  // namespace
}  // namespace himoe::model
