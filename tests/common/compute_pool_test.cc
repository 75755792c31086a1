#include "common/compute_pool.h"

#include <atomic>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace himoe {
namespace {

// Blocks a worker until released.
struct Gate {
  std::promise<void> open;
  std::shared_future<void> opened = open.get_future().share();
};

TEST(ComputePoolTest, RunsWorkInOrderAndRefusesBeyondTheQueue) {
  auto pool = ComputePool::Create(ComputePoolOptions{1, 2, "--max_queue"});
  ASSERT_TRUE(pool.ok()) << pool.status();
  Gate gate;
  std::promise<void> started;
  ASSERT_TRUE((*pool)->Submit([&started, opened = gate.opened] {
    started.set_value();
    opened.wait();
  }).ok());
  started.get_future().wait();
  std::vector<int> order;
  std::mutex mu;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE((*pool)->Submit([&, i] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(i);
    }).ok());
  }
  EXPECT_EQ((*pool)->queued(), 2);
  EXPECT_EQ((*pool)->running(), 1);
  const absl::Status full = (*pool)->Submit([] {});
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(full.message(),
            "compute queue full: 2 requests waiting for 1 busy worker(s) (--max_queue = 2); "
            "retry later");
  EXPECT_EQ((*pool)->rejected(), 1);
  gate.open.set_value();
  pool->reset();  // runs what is queued, then joins
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
}

// An idle worker takes work without a queue slot: max_queue 0 still accepts
// one call per idle worker.
TEST(ComputePoolTest, IdleWorkersNeedNoQueueSlot) {
  auto pool = ComputePool::Create(ComputePoolOptions{2, 0, "limit"});
  ASSERT_TRUE(pool.ok()) << pool.status();
  Gate gate;
  std::atomic<int> ran{0};
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE((*pool)->Submit([&ran, opened = gate.opened] {
      opened.wait();
      ++ran;
    }).ok()) << i;
  }
  EXPECT_EQ((*pool)->Submit([] {}).code(), absl::StatusCode::kResourceExhausted);
  gate.open.set_value();
  pool->reset();
  EXPECT_EQ(ran.load(), 2);
}

TEST(ComputePoolTest, BadOptionsAreRefusedNamingThem) {
  EXPECT_EQ(ComputePool::Create(ComputePoolOptions{0, 1, "q"}).status().message(),
            "compute workers: 0; expected >= 1");
  EXPECT_EQ(ComputePool::Create(ComputePoolOptions{1, -1, "--max_queue"}).status().message(),
            "--max_queue: -1; expected >= 0");
}

}  // namespace
}  // namespace himoe
