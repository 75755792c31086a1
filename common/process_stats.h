#ifndef HIMOE_COMMON_PROCESS_STATS_H_
#define HIMOE_COMMON_PROCESS_STATS_H_

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

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
