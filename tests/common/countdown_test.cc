#include "common/countdown.h"

#include <atomic>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace himoe {
namespace {

TEST(CountdownTest, WaitReturnsAfterEveryDoneAndSeesWhatEachWrote) {
  constexpr int kThreads = 4;
  std::vector<int> written(kThreads, 0);
  std::atomic<int> done_calls{0};
  Countdown pending(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      written[i] = i + 1;
      done_calls.fetch_add(1);
      pending.Done();
    });
  }
  pending.Wait();
  EXPECT_EQ(done_calls.load(), kThreads);
  for (int i = 0; i < kThreads; ++i) EXPECT_EQ(written[i], i + 1);
  for (std::thread& t : threads) t.join();
}

TEST(CountdownTest, ZeroDoesNotWait) {
  Countdown none(0);
  none.Wait();
  Countdown one(1);
  one.Done();
  one.Wait();
  one.Wait();  // stays open
}

}  // namespace
}  // namespace himoe
