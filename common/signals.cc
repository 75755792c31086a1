#include "common/signals.h"

#include <pthread.h>
#include <signal.h>

#include <ctime>
#include <initializer_list>

namespace himoe {
namespace {

extern "C" void IgnoreSignal(int) {}

bool g_watch_children = false;

sigset_t WatchedSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  if (g_watch_children) sigaddset(&set, SIGCHLD);
  return set;
}

bool IsStopSignal(int sig) { return sig == SIGINT || sig == SIGTERM || sig == SIGHUP; }

}  // namespace

void BlockStopSignals(bool watch_children) {
  g_watch_children = watch_children;
  // A no-op handler, so that an inherited SIG_IGN cannot swallow a stop
  // signal; SIGCHLD keeps its default, so that children stay waitable.
  struct sigaction action = {};
  action.sa_handler = IgnoreSignal;
  sigemptyset(&action.sa_mask);
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) sigaction(sig, &action, nullptr);
  if (watch_children) {
    action.sa_handler = SIG_DFL;
    sigaction(SIGCHLD, &action, nullptr);
  }
  const sigset_t set = WatchedSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForStopSignal(std::chrono::milliseconds timeout) {
  const sigset_t set = WatchedSignals();
  timespec ts;
  ts.tv_sec = timeout.count() / 1000;
  ts.tv_nsec = (timeout.count() % 1000) * 1000000L;
  const int sig = sigtimedwait(&set, nullptr, &ts);
  return IsStopSignal(sig) ? sig : 0;
}

int PendingStopSignal() {
  sigset_t pending;
  sigemptyset(&pending);
  if (sigpending(&pending) != 0) return 0;
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
    if (sigismember(&pending, sig)) return WaitForStopSignal(std::chrono::milliseconds(0));
  }
  return 0;
}

}  // namespace himoe
