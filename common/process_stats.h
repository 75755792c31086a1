#ifndef HIMOE_COMMON_PROCESS_STATS_H_
#define HIMOE_COMMON_PROCESS_STATS_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace himoe {

// Peak resident set size (VmHWM in /proc/<pid>/status) of a running process,
// in bytes; pid 0 is this process.
absl::StatusOr<int64_t> PeakRssBytes(int pid = 0);

// Seconds since process `pid` (0 = this one) was started, from /proc (its
// start time in clock ticks since boot against /proc/uptime): for this
// process it includes the dynamic loading and static initialisers before
// main. 10 ms resolution.
absl::StatusOr<double> SecondsSinceProcessStart(int pid = 0);

// CPU time (user + system, every thread) process `pid` (0 = this one) has
// used since it started, from /proc/<pid>/stat: 10 ms resolution.
absl::StatusOr<double> CpuSeconds(int pid = 0);

// The CPU time processes use over chosen stretches of wall time (a run's
// timed steps, say, leaving out its evaluations): what part of the cores a
// multi-process job keeps busy. Not thread-safe.
class CpuMeter {
 public:
  // pid 0 is this process.
  explicit CpuMeter(std::vector<int> pids);
  // Begins a stretch; an error if one is running or a process is gone.
  absl::Status Start();
  // Ends the running stretch and adds its wall and CPU time.
  absl::Status Stop();
  bool running() const { return running_; }
  double wall_seconds() const { return wall_seconds_; }
  // Per process, in the order of `pids`.
  const std::vector<double>& cpu_seconds() const { return cpu_seconds_; }

 private:
  std::vector<int> pids_;
  std::vector<double> cpu_seconds_;
  std::vector<double> started_cpu_;
  std::chrono::steady_clock::time_point started_;
  double wall_seconds_ = 0;
  bool running_ = false;
};

// Where a service's start-up goes: created first thing in main, it counts
// exec -> now as "libraries" (loading LibTorch, gRPC, their static
// initialisers); each Mark(phase) ends a phase.
class StartupTimer {
 public:
  StartupTimer();
  void Mark(std::string phase);
  double total_seconds() const;
  // "ready 0.71 s after exec: libraries 0.30 s, compute set-up 0.38 s, ..."
  std::string Summary() const;

 private:
  std::chrono::steady_clock::time_point last_;
  std::vector<std::pair<std::string, double>> phases_;
};

}  // namespace himoe

#endif  // HIMOE_COMMON_PROCESS_STATS_H_
