#include "common/signals.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace himoe {
namespace {

using ::testing::HasSubstr;

// A child that aborts (as glibc does on a corrupted heap) writes the signal
// and its stack, with abort's own frame, and still dies of SIGABRT.
TEST(PrintStackOnCrashTest, AnAbortPrintsTheStackAndStillDiesOfIt) {
  PrintStackOnCrash();  // in the parent: the child forks with it installed
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    std::abort();
  }
  close(fds[1]);
  std::string out;
  char buffer[4096];
  for (ssize_t n; (n = read(fds[0], buffer, sizeof(buffer))) > 0;) out.append(buffer, n);
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  for (const int sig : {SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE}) signal(sig, SIG_DFL);

  ASSERT_TRUE(WIFSIGNALED(status)) << out;
  EXPECT_EQ(WTERMSIG(status), SIGABRT);
  EXPECT_THAT(out, HasSubstr("*** fatal signal Aborted; stack of the thread that got it:"));
  EXPECT_THAT(out, HasSubstr("(abort+"));
}

// Each case runs in a child (a death test), which reports what
// PendingStopSignal took after the signals were raised.

// A shell without job control starts background commands with SIGINT
// ignored; the process still takes it.
TEST(StopSignalsTest, AnInheritedIgnoredInterruptIsStillTaken) {
  EXPECT_EXIT(
      {
        signal(SIGINT, SIG_IGN);
        BlockStopSignals();
        raise(SIGINT);
        std::fprintf(stderr, "took %d", PendingStopSignal());
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "took 2$");
}

// Under nohup (SIGHUP inherited ignored) a hangup is not a stop; SIGTERM is.
TEST(StopSignalsTest, AHangupStaysIgnoredUnderNohup) {
  EXPECT_EXIT(
      {
        signal(SIGHUP, SIG_IGN);
        BlockStopSignals();
        raise(SIGHUP);
        const int hangup = PendingStopSignal();
        raise(SIGTERM);
        std::fprintf(stderr, "took %d then %d", hangup, PendingStopSignal());
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "took 0 then 15$");
}

TEST(StopSignalsTest, AHangupStopsWhenNotIgnored) {
  EXPECT_EXIT(
      {
        signal(SIGHUP, SIG_DFL);
        BlockStopSignals();
        raise(SIGHUP);
        const int first = PendingStopSignal();
        std::fprintf(stderr, "took %d then %d", first, PendingStopSignal());
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "took 1 then 0$");
}

}  // namespace
}  // namespace himoe
