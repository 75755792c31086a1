#include "common/signals.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

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

}  // namespace
}  // namespace himoe
