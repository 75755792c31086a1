#include "trainer/micro_batch_turns.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"

namespace himoe::trainer {
namespace {

// A micro-batch's Wait returns only once the one before it passed the same
// point. (The sleep lets the waiter reach Wait first; a broken Wait is then
// caught, and a correct one passes however the threads are scheduled.)
TEST(MicroBatchTurnsTest, AMicroBatchWaitsForTheOneBeforeItAtTheSamePoint) {
  MicroBatchTurns turns(/*layers=*/2);
  turns.Begin();
  ASSERT_TRUE(turns.Wait(Turn::kRoute, 1, 0).ok());  // micro-batch 0 never waits
  std::vector<int> order;
  std::atomic<bool> returned{false};
  std::thread second([&] {
    const absl::Status s = turns.Wait(Turn::kRoute, 1, 1);
    EXPECT_TRUE(s.ok()) << s;
    returned = true;
    order.push_back(1);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(returned);
  // Other points, and other layers, do not let it through.
  turns.Pass(Turn::kRoute, 0, 0);
  turns.Pass(Turn::kGradientSum, 0, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(returned);
  order.push_back(0);
  turns.Pass(Turn::kRoute, 1, 0);
  second.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1}));
}

TEST(MicroBatchTurnsTest, PassedAndFinishedMicroBatchesLetTheNextThrough) {
  MicroBatchTurns turns(/*layers=*/1);
  turns.Begin();
  turns.Pass(Turn::kGradientSum, 0, 0);
  EXPECT_TRUE(turns.Wait(Turn::kGradientSum, 0, 1).ok());
  // Micro-batch 1 passes no more points (it failed, or had nothing there):
  // micro-batch 2 does not wait for it.
  turns.Finish(1);
  EXPECT_TRUE(turns.Wait(Turn::kGradientSum, 0, 2).ok());
  turns.Finish(0);
  EXPECT_TRUE(turns.Wait(Turn::kRoute, 0, 2).ok());
}

TEST(MicroBatchTurnsTest, CancelWakesEveryWaiterWithTheErrorUntilTheNextStep) {
  MicroBatchTurns turns(/*layers=*/1);
  turns.Begin();
  absl::Status woken;
  std::thread waiter([&] { woken = turns.Wait(Turn::kGradientSum, 0, 3); });
  turns.Cancel(absl::UnavailableError("expert group 2 is gone"));
  waiter.join();
  EXPECT_EQ(woken, absl::UnavailableError("expert group 2 is gone"));
  EXPECT_EQ(turns.Wait(Turn::kRoute, 0, 1), absl::UnavailableError("expert group 2 is gone"));
  // A later cancel keeps the first error.
  turns.Cancel(absl::CancelledError("later"));
  EXPECT_TRUE(absl::IsUnavailable(turns.Wait(Turn::kRoute, 0, 1)));
  // The next step starts clean.
  turns.Begin();
  EXPECT_TRUE(turns.Wait(Turn::kRoute, 0, 0).ok());
  turns.Pass(Turn::kRoute, 0, 0);
  EXPECT_TRUE(turns.Wait(Turn::kRoute, 0, 1).ok());
}

// Outside a step (a lone training Forward, say) nothing waits, and End wakes
// whoever waits when the step ends.
TEST(MicroBatchTurnsTest, OutsideAStepNothingWaits) {
  MicroBatchTurns turns(/*layers=*/1);
  EXPECT_TRUE(turns.Wait(Turn::kRoute, 0, 5).ok());
  turns.Begin();
  turns.Cancel(absl::InternalError("step failed"));
  turns.End();
  EXPECT_TRUE(turns.Wait(Turn::kGradientSum, 0, 5).ok());
  turns.Begin();
  absl::Status woken = absl::UnknownError("not woken");
  std::thread waiter([&] { woken = turns.Wait(Turn::kRoute, 0, 2); });
  turns.End();
  waiter.join();
  EXPECT_TRUE(woken.ok()) << woken;
}

}  // namespace
}  // namespace himoe::trainer
