#include "common/parallel_for.h"

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace himoe {
namespace {

// Each index runs exactly once, and with 2 threads on 2 indices the two calls
// overlap: each waits until the other has started (a liveness bound of 60 s,
// not a timing).
TEST(ParallelForTest, EachIndexOnceOnItsOwnThread) {
  std::vector<std::atomic<int>> runs(5);
  ParallelFor(5, 2, [&](int64_t i) { runs[i].fetch_add(1); });
  for (const auto& r : runs) EXPECT_EQ(r.load(), 1);

  std::atomic<int> started{0};
  std::atomic<bool> both_seen{true};
  std::vector<std::thread::id> ids(2);
  ParallelFor(2, 2, [&](int64_t i) {
    ids[i] = std::this_thread::get_id();
    EXPECT_TRUE(InParallelRegion());
    started.fetch_add(1);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (started.load() < 2) {
      if (std::chrono::steady_clock::now() > give_up) {
        both_seen = false;
        return;
      }
      std::this_thread::yield();
    }
  });
  EXPECT_TRUE(both_seen.load());
  EXPECT_NE(ids[0], ids[1]);
}

// One thread, one index, or a call from inside a region run inline, in order.
TEST(ParallelForTest, InlineWhereThereIsNothingToSplit) {
  const std::thread::id self = std::this_thread::get_id();
  std::vector<int64_t> order;
  ParallelFor(4, 1, [&](int64_t i) {
    EXPECT_EQ(std::this_thread::get_id(), self);
    EXPECT_FALSE(InParallelRegion());
    order.push_back(i);
  });
  EXPECT_EQ(order, (std::vector<int64_t>{0, 1, 2, 3}));
  ParallelFor(2, 2, [&](int64_t outer) {
    const std::thread::id here = std::this_thread::get_id();
    ParallelFor(3, 2, [&](int64_t) { EXPECT_EQ(std::this_thread::get_id(), here); });
  });
  ParallelFor(0, 2, [&](int64_t) { ADD_FAILURE() << "no index to run"; });
}

TEST(ParallelForTest, AnExceptionReachesTheCallerAfterEveryIndexRan) {
  std::atomic<int> ran{0};
  EXPECT_THROW(ParallelFor(4, 2,
                           [&](int64_t i) {
                             ran.fetch_add(1);
                             if (i == 1) throw std::runtime_error("index 1");
                           }),
               std::runtime_error);
  EXPECT_EQ(ran.load(), 4);
}

}  // namespace
}  // namespace himoe
