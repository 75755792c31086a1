#include "common/probe_process.h"

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace himoe {
namespace {

using ::testing::HasSubstr;

constexpr char kRequestEnv[] = "HIMOE_TEST_FRESH_PROCESS_PROBE";

// This test binary, started again by RunInFreshProcess, answers before main:
// "OK <the number asked> <BLIS_NUM_THREADS>".
bool AnswerIfAsked() {
  const char* request = std::getenv(kRequestEnv);
  if (request == nullptr) return false;
  const std::vector<std::string> parts = absl::StrSplit(request, ' ');
  int fd = -1;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &fd)) _exit(2);
  if (parts[0] == "silent") _exit(0);
  const char* threads = std::getenv("BLIS_NUM_THREADS");
  AnswerAndExit(fd, absl::StrCat("OK ", parts[0], " ", threads ? threads : "unset"));
}

[[maybe_unused]] const bool kAnsweredAndExited = AnswerIfAsked();

TEST(ProbeProcessTest, AnswersAreParsed) {
  std::string error;
  EXPECT_EQ(ParseProbeAnswer("OK 12.5", &error), 12.5);
  EXPECT_EQ(error, "");
  EXPECT_EQ(ParseProbeAnswer("ERR wrong result: max error 3", &error), 0);
  EXPECT_EQ(error, "wrong result: max error 3");
  error.clear();
  EXPECT_EQ(ParseProbeAnswer("OK fast", &error), 0);
  EXPECT_EQ(error, "OK fast");
}

// The child sees the variables set and unset; this process does not.
TEST(ProbeProcessTest, TheChildRunsWithItsEnvironment) {
  setenv("HIMOE_TEST_PROBE_UNSET", "here", 1);
  unsetenv("HIMOE_TEST_PROBE_SET");
  const std::string answer = RunInChild(
      {{"HIMOE_TEST_PROBE_SET", "7"}, {"HIMOE_TEST_PROBE_UNSET", ""}}, [] {
        const char* set = getenv("HIMOE_TEST_PROBE_SET");
        const char* unset = getenv("HIMOE_TEST_PROBE_UNSET");
        return absl::StrCat("OK ", set ? set : "none", unset ? " still set" : "");
      });
  EXPECT_EQ(answer, "OK 7");
  EXPECT_EQ(getenv("HIMOE_TEST_PROBE_SET"), nullptr);
  EXPECT_STREQ(getenv("HIMOE_TEST_PROBE_UNSET"), "here");
  unsetenv("HIMOE_TEST_PROBE_UNSET");
}

// A child that dies (SIGILL on kernels the CPU lacks), says nothing or hangs
// is an error, never a rate.
TEST(ProbeProcessTest, AChildThatFailsIsAnError) {
  EXPECT_EQ(RunInChild({}, []() -> std::string {
              raise(SIGILL);
              return "OK 1";
            }),
            absl::StrCat("ERR killed by signal ", SIGILL));
  EXPECT_EQ(RunInChild({}, [] { return std::string(); }), "ERR no answer");
  EXPECT_EQ(RunInChild(
                {},
                []() -> std::string {
                  pause();
                  return "OK 1";
                },
                /*timeout_seconds=*/1),
            "ERR timed out");
}

// This program started again answers on the pipe it was given, with the
// environment it was given.
TEST(ProbeProcessTest, AFreshProcessAnswersBeforeMain) {
  const std::string answer = RunInFreshProcess(
      kRequestEnv, [](int fd) { return absl::StrCat("42 ", fd); },
      {{"BLIS_NUM_THREADS", "3"}});
  EXPECT_EQ(answer, "OK 42 3");
  EXPECT_EQ(getenv(kRequestEnv), nullptr);
  EXPECT_THAT(RunInFreshProcess(
                  kRequestEnv, [](int fd) { return absl::StrCat("silent ", fd); }, {}),
              HasSubstr("ERR no answer"));
}

}  // namespace
}  // namespace himoe
