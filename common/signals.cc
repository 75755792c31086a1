#include "common/signals.h"

#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <ctime>
#include <initializer_list>

namespace himoe {
namespace {

extern "C" void IgnoreSignal(int) {}

bool g_watch_children = false;
bool g_hangup_ignored = false;  // inherited SIG_IGN (nohup)

sigset_t WatchedSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  if (!g_hangup_ignored) sigaddset(&set, SIGHUP);
  if (g_watch_children) sigaddset(&set, SIGCHLD);
  return set;
}

bool IsStopSignal(int sig) {
  return sig == SIGINT || sig == SIGTERM || (sig == SIGHUP && !g_hangup_ignored);
}

void WriteAll(const char* text) {
  for (size_t left = strlen(text); left > 0;) {
    const ssize_t n = write(STDERR_FILENO, text, left);
    if (n <= 0) return;
    text += n;
    left -= static_cast<size_t>(n);
  }
}

// Installed with SA_RESETHAND: re-raising the signal after the stack is
// written kills the process as the default action would (core dump included).
extern "C" void PrintStackAndDie(int sig) {
  WriteAll("\n*** fatal signal ");
  WriteAll(strsignal(sig));
  WriteAll("; stack of the thread that got it:\n");
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  raise(sig);
}

}  // namespace

void BlockStopSignals(bool watch_children) {
  g_watch_children = watch_children;
  struct sigaction hangup = {};
  sigaction(SIGHUP, nullptr, &hangup);
  g_hangup_ignored = hangup.sa_handler == SIG_IGN;
  // A no-op handler, so that an inherited SIG_IGN cannot swallow SIGINT (a
  // shell without job control starts background commands so) or SIGTERM;
  // SIGCHLD keeps its default, so that children stay waitable.
  struct sigaction action = {};
  action.sa_handler = IgnoreSignal;
  sigemptyset(&action.sa_mask);
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
    if (sig != SIGHUP || !g_hangup_ignored) sigaction(sig, &action, nullptr);
  }
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
    if (IsStopSignal(sig) && sigismember(&pending, sig)) {
      return WaitForStopSignal(std::chrono::milliseconds(0));
    }
  }
  return 0;
}

void PrintStackOnCrash() {
  // backtrace() loads libgcc on its first call, which must not happen in the
  // handler (it may allocate on a corrupted heap).
  void* warm[1];
  backtrace(warm, 1);
  struct sigaction action {};
  action.sa_handler = PrintStackAndDie;
  action.sa_flags = SA_RESETHAND;
  sigemptyset(&action.sa_mask);
  for (const int sig : {SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE}) sigaction(sig, &action, nullptr);
}

}  // namespace himoe
