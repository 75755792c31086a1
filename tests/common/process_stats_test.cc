#include "common/process_stats.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

extern char** environ;

namespace himoe {
namespace {

TEST(ProcessStatsTest, PeakRssGrowsByTheBytesTouched) {
  const absl::StatusOr<int64_t> before = PeakRssBytes();
  ASSERT_TRUE(before.ok()) << before.status();
  constexpr int64_t kBytes = 64 << 20;
  std::unique_ptr<char[]> block(new char[kBytes]);
  std::memset(block.get(), 1, kBytes);  // resident only once written
  const absl::StatusOr<int64_t> after = PeakRssBytes(::getpid());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_GE(*after - *before, kBytes - (4 << 20));
  EXPECT_EQ(block[kBytes - 1], 1);
}

TEST(ProcessStatsTest, AMissingProcessIsNotFound) {
  // Above the largest pid Linux hands out (2^22).
  EXPECT_EQ(PeakRssBytes(1 << 23).status().code(), absl::StatusCode::kNotFound);
}

// A child's age from /proc: at least the time we slept since spawning it, at
// most the time since just before the spawn (plus the 10 ms tick).
TEST(ProcessStatsTest, SecondsSinceStartIsTheProcesssAge) {
  const auto before = std::chrono::steady_clock::now();
  pid_t pid = -1;
  char sleep_path[] = "/bin/sleep";
  char seconds[] = "30";
  char* argv[] = {sleep_path, seconds, nullptr};
  ASSERT_EQ(posix_spawn(&pid, sleep_path, nullptr, nullptr, argv, environ), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const absl::StatusOr<double> age = SecondsSinceProcessStart(pid);
  const double bound =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - before).count();
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  ASSERT_TRUE(age.ok()) << age.status();
  EXPECT_GE(*age, 0.3 - 0.011);
  EXPECT_LE(*age, bound + 0.011);
  const absl::StatusOr<double> self = SecondsSinceProcessStart();
  ASSERT_TRUE(self.ok()) << self.status();
  EXPECT_GE(*self, *age - 0.011);  // this process is older than its child
  EXPECT_EQ(SecondsSinceProcessStart(1 << 23).status().code(), absl::StatusCode::kNotFound);
}

// This process spins until /proc says it used 0.2 s more CPU; a sleeping
// child uses none. The meter's stretches leave out the sleep between them.
// Readings are whole 10 ms ticks, and the kernel may charge a tick to the
// thread it finds running: a difference may be off by a few.
TEST(ProcessStatsTest, CpuMeterCountsTheCpuEachProcessUsedInItsStretches) {
  pid_t pid = -1;
  char sleep_path[] = "/bin/sleep";
  char seconds[] = "30";
  char* argv[] = {sleep_path, seconds, nullptr};
  ASSERT_EQ(posix_spawn(&pid, sleep_path, nullptr, nullptr, argv, environ), 0);
  constexpr double kTicks = 0.031;
  CpuMeter meter({0, pid});
  const auto begin = std::chrono::steady_clock::now();
  absl::Status status = meter.Start();
  EXPECT_EQ(meter.Start().code(), absl::StatusCode::kFailedPrecondition);
  const absl::StatusOr<double> start = CpuSeconds();
  ASSERT_TRUE(start.ok()) << start.status();
  volatile uint64_t spins = 0;
  for (absl::StatusOr<double> now = start; now.ok() && *now < *start + 0.2; now = CpuSeconds()) {
    for (int i = 0; i < 100000; ++i) spins = spins + 1;
  }
  if (status.ok()) status = meter.Stop();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // outside the stretches
  if (status.ok()) status = meter.Start();
  if (status.ok()) status = meter.Stop();
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_FALSE(meter.running());
  EXPECT_EQ(meter.Stop().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_EQ(meter.cpu_seconds().size(), 2u);
  EXPECT_GE(meter.cpu_seconds()[0], 0.2 - kTicks);
  // One thread uses at most the wall time it ran.
  EXPECT_LE(meter.cpu_seconds()[0], meter.wall_seconds() + kTicks);
  EXPECT_LE(meter.cpu_seconds()[1], kTicks);
  EXPECT_LE(meter.wall_seconds(), elapsed - 0.2);
  EXPECT_GT(spins, 0u);
  CpuMeter gone({1 << 23});
  EXPECT_EQ(gone.Start().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(CpuSeconds(1 << 23).status().code(), absl::StatusCode::kNotFound);
}

TEST(ProcessStatsTest, StartupTimerSumsItsPhases) {
  StartupTimer timer;
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  timer.Mark("first");
  timer.Mark("second");
  const std::string summary = timer.Summary();
  EXPECT_THAT(summary, ::testing::MatchesRegex(
                           "ready [0-9]+\\.[0-9]{2} s after exec: libraries [0-9]+\\.[0-9]{2} s, "
                           "first [0-9]+\\.[0-9]{2} s, second [0-9]+\\.[0-9]{2} s"));
  const absl::StatusOr<double> since_exec = SecondsSinceProcessStart();
  ASSERT_TRUE(since_exec.ok());
  EXPECT_GE(timer.total_seconds(), 0.02);
  EXPECT_LE(timer.total_seconds(), *since_exec + 0.011);
}

}  // namespace
}  // namespace himoe
