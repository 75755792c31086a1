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
