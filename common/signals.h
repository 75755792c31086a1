#ifndef HIMOE_COMMON_SIGNALS_H_
#define HIMOE_COMMON_SIGNALS_H_

#include <chrono>

namespace himoe {

// Stop signals (SIGINT, SIGTERM, SIGHUP) are taken synchronously: main()
// calls BlockStopSignals() before any thread starts (gRPC's and torch's
// threads inherit the mask), then polls WaitForStopSignal. With
// `watch_children`, SIGCHLD is blocked too, so that a wait wakes up when a
// child process ends (the launcher). SIGINT and SIGTERM are taken even where
// the process inherited them ignored; SIGHUP stays ignored then (nohup).
void BlockStopSignals(bool watch_children = false);

// Waits up to `timeout`; returns the stop signal that came, or 0 (timeout, or
// only a SIGCHLD).
int WaitForStopSignal(std::chrono::milliseconds timeout);

// A stop signal already pending (consumed), without waiting; else 0.
int PendingStopSignal();

// On SIGSEGV, SIGABRT (glibc's heap checks), SIGBUS, SIGILL or SIGFPE: writes
// the signal and this thread's stack (symbols where the binary exports them)
// to stderr, then dies of the signal as it would have. Call it first in
// main(). Stop signals are left alone.
void PrintStackOnCrash();

}  // namespace himoe

#endif  // HIMOE_COMMON_SIGNALS_H_
