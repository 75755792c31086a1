// What the subprocess tests ask of processes: gone, and no child left.
#ifndef HIMOE_TESTS_DEPLOY_CHILD_CHECKS_H_
#define HIMOE_TESTS_DEPLOY_CHILD_CHECKS_H_

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <cerrno>

namespace himoe::test_util {

// True when no process `pid` exists (a zombie still exists).
inline bool ProcessGone(pid_t pid) { return kill(pid, 0) != 0 && errno == ESRCH; }

// True when this process has no child at all, reaped or not.
inline bool NoChildLeft() {
  int status = 0;
  return waitpid(-1, &status, WNOHANG) < 0 && errno == ECHILD;
}

}  // namespace himoe::test_util

#endif  // HIMOE_TESTS_DEPLOY_CHILD_CHECKS_H_
