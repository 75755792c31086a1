#include "common/parallel_for.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

namespace himoe {
namespace {

// Counts the calling thread in and waits until `n` threads have: false if
// they have not within 60 s (a liveness bound, not a timing).
bool MeetOthers(std::atomic<int>& started, int n) {
  started.fetch_add(1);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (started.load() < n) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

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
    if (!MeetOthers(started, 2)) both_seen = false;
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

// Chunks cover [begin, end) once, in order, cut as at::parallel_for cuts:
// ceil(n / team) indices each. With 2 threads the two chunks run at once.
TEST(ParallelForRangeTest, ChunksCoverTheRangeOnTheirOwnThreads) {
  std::mutex mu;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  std::vector<std::thread::id> ids;
  std::atomic<int> started{0};
  std::atomic<bool> both_seen{true};
  ParallelForRange(3, 14, 1, 2, [&](int64_t b, int64_t e) {
    {
      std::lock_guard<std::mutex> lock(mu);
      chunks.emplace_back(b, e);
      ids.push_back(std::this_thread::get_id());
    }
    if (!MeetOthers(started, 2)) both_seen = false;
  });
  std::sort(chunks.begin(), chunks.end());
  EXPECT_EQ(chunks, (std::vector<std::pair<int64_t, int64_t>>{{3, 9}, {9, 14}}));
  EXPECT_TRUE(both_seen.load());
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_NE(ids[0], ids[1]);
}

// The grain bounds the team: 10 indices at grain 6 make 2 chunks of 5, at
// grain 10 one chunk, run inline; so do 1 thread and a nested call.
TEST(ParallelForRangeTest, GrainThreadsAndNestingBoundTheTeam) {
  std::mutex mu;
  std::vector<std::pair<int64_t, int64_t>> chunks;
  auto record = [&](int64_t b, int64_t e) {
    std::lock_guard<std::mutex> lock(mu);
    chunks.emplace_back(b, e);
  };
  ParallelForRange(0, 10, 6, 8, record);
  std::sort(chunks.begin(), chunks.end());
  EXPECT_EQ(chunks, (std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 10}}));

  const std::thread::id self = std::this_thread::get_id();
  for (const auto& [grain, threads] : std::vector<std::pair<int64_t, int>>{{10, 8}, {1, 1}}) {
    chunks.clear();
    ParallelForRange(0, 10, grain, threads, [&](int64_t b, int64_t e) {
      EXPECT_EQ(std::this_thread::get_id(), self);
      record(b, e);
    });
    EXPECT_EQ(chunks, (std::vector<std::pair<int64_t, int64_t>>{{0, 10}}));
  }
  ParallelFor(2, 2, [&](int64_t) {
    const std::thread::id here = std::this_thread::get_id();
    int calls = 0;
    ParallelForRange(0, 100, 1, 2, [&](int64_t b, int64_t e) {
      EXPECT_EQ(std::this_thread::get_id(), here);
      EXPECT_EQ(b, 0);
      EXPECT_EQ(e, 100);
      ++calls;
    });
    EXPECT_EQ(calls, 1);
  });
  ParallelForRange(5, 5, 1, 2, [&](int64_t, int64_t) { ADD_FAILURE() << "empty range"; });
}

TEST(ParallelForRangeTest, AnExceptionReachesTheCallerAfterEveryChunkRan) {
  std::atomic<int> ran{0};
  EXPECT_THROW(ParallelForRange(0, 4, 1, 2,
                                [&](int64_t b, int64_t) {
                                  ran.fetch_add(1);
                                  if (b == 0) throw std::runtime_error("chunk 0");
                                }),
               std::runtime_error);
  EXPECT_EQ(ran.load(), 2);
}

}  // namespace
}  // namespace himoe
