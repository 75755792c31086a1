#ifndef HIMOE_COMMON_PROCESS_STATS_H_
#define HIMOE_COMMON_PROCESS_STATS_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace himoe {

// Peak resident set size (VmHWM in /proc/<pid>/status) of a running process,
// in bytes; pid 0 is this process.
absl::StatusOr<int64_t> PeakRssBytes(int pid = 0);

}  // namespace himoe

#endif  // HIMOE_COMMON_PROCESS_STATS_H_
