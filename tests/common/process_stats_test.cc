#include "common/process_stats.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>

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

// A child's age from /proc: readings only grow, and this process, which
// started before its child, is older than it (up to the 10 ms tick the
// start times are kept in).
TEST(ProcessStatsTest, SecondsSinceStartIsTheProcesssAge) {
  pid_t pid = -1;
  char sleep_path[] = "/bin/sleep";
  char seconds[] = "30";
  char* argv[] = {sleep_path, seconds, nullptr};
  ASSERT_EQ(posix_spawn(&pid, sleep_path, nullptr, nullptr, argv, environ), 0);
  const absl::StatusOr<double> age = SecondsSinceProcessStart(pid);
  const absl::StatusOr<double> later = SecondsSinceProcessStart(pid);
  const absl::StatusOr<double> self = SecondsSinceProcessStart();
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  ASSERT_TRUE(age.ok()) << age.status();
  ASSERT_TRUE(later.ok()) << later.status();
  ASSERT_TRUE(self.ok()) << self.status();
  EXPECT_GE(*age, 0.0);
  EXPECT_GE(*later, *age);
  EXPECT_GE(*self, *later - 0.011);  // this process is older than its child
  EXPECT_EQ(SecondsSinceProcessStart(1 << 23).status().code(), absl::StatusCode::kNotFound);
}

// This process spins until /proc says it used 0.2 s more CPU inside the
// meter's first stretch, then 0.2 s more between the stretches; a sleeping
// child uses none. The meter counts the first 0.2 s and leaves out the
// second. Readings are whole 10 ms ticks, and the kernel may charge a tick to
// the thread it finds running: a difference may be off by a few.
TEST(ProcessStatsTest, CpuMeterCountsTheCpuEachProcessUsedInItsStretches) {
  pid_t pid = -1;
  char sleep_path[] = "/bin/sleep";
  char seconds[] = "30";
  char* argv[] = {sleep_path, seconds, nullptr};
  ASSERT_EQ(posix_spawn(&pid, sleep_path, nullptr, nullptr, argv, environ), 0);
  constexpr double kTicks = 0.031;
  volatile uint64_t spins = 0;
  // Spins until this process's CPU time has grown by `amount`.
  const auto spin = [&](double amount) {
    const absl::StatusOr<double> from = CpuSeconds();
    if (!from.ok()) return from.status();
    for (;;) {
      const absl::StatusOr<double> now = CpuSeconds();
      if (!now.ok()) return now.status();
      if (*now >= *from + amount) return absl::OkStatus();
      for (int i = 0; i < 100000; ++i) spins = spins + 1;
    }
  };
  CpuMeter meter({0, pid});
  const absl::StatusOr<double> begin = CpuSeconds();
  ASSERT_TRUE(begin.ok()) << begin.status();
  absl::Status status = meter.Start();
  EXPECT_EQ(meter.Start().code(), absl::StatusCode::kFailedPrecondition);
  if (status.ok()) status = spin(0.2);
  if (status.ok()) status = meter.Stop();
  if (status.ok()) status = spin(0.2);  // outside the stretches
  if (status.ok()) status = meter.Start();
  if (status.ok()) status = meter.Stop();
  const absl::StatusOr<double> end = CpuSeconds();
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_TRUE(end.ok()) << end.status();
  EXPECT_FALSE(meter.running());
  EXPECT_EQ(meter.Stop().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_EQ(meter.cpu_seconds().size(), 2u);
  EXPECT_GE(meter.cpu_seconds()[0], 0.2 - kTicks);
  // All the CPU used, less the 0.2 s spent between the stretches.
  EXPECT_LE(meter.cpu_seconds()[0], (*end - *begin) - 0.2 + kTicks);
  // One thread uses at most the wall time it ran.
  EXPECT_LE(meter.cpu_seconds()[0], meter.wall_seconds() + kTicks);
  EXPECT_LE(meter.cpu_seconds()[1], kTicks);
  EXPECT_GT(spins, 0u);
  CpuMeter gone({1 << 23});
  EXPECT_EQ(gone.Start().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(CpuSeconds(1 << 23).status().code(), absl::StatusCode::kNotFound);
}

// The summary's total is the sum of its phases (each printed to 0.01 s), and
// total_seconds() is that total; a later mark only adds.
TEST(ProcessStatsTest, StartupTimerSumsItsPhases) {
  StartupTimer timer;
  timer.Mark("first");
  const double after_first = timer.total_seconds();
  timer.Mark("second");
  EXPECT_GE(timer.total_seconds(), after_first);
  const std::string summary = timer.Summary();
  EXPECT_THAT(summary, ::testing::MatchesRegex(
                           "ready [0-9]+\\.[0-9]{2} s after exec: libraries [0-9]+\\.[0-9]{2} s, "
                           "first [0-9]+\\.[0-9]{2} s, second [0-9]+\\.[0-9]{2} s"));
  double total = 0, libraries = 0, first = 0, second = 0;
  ASSERT_EQ(std::sscanf(summary.c_str(),
                        "ready %lf s after exec: libraries %lf s, first %lf s, second %lf s",
                        &total, &libraries, &first, &second),
            4)
      << summary;
  EXPECT_NEAR(total, libraries + first + second, 0.015 + 1e-9) << summary;  // 4 roundings
  EXPECT_NEAR(total, timer.total_seconds(), 0.005 + 1e-9) << summary;
  const absl::StatusOr<double> since_exec = SecondsSinceProcessStart();
  ASSERT_TRUE(since_exec.ok());
  EXPECT_LE(timer.total_seconds(), *since_exec + 0.011);  // the timer starts at exec
}

}  // namespace
}  // namespace himoe
