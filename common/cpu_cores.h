#ifndef HIMOE_COMMON_CPU_CORES_H_
#define HIMOE_COMMON_CPU_CORES_H_

#include <optional>

#include "absl/strings/string_view.h"

namespace himoe {

// Number of CPU cores available to this process: its affinity mask, capped by
// its cgroup's CPU quota (a Kubernetes CPU limit) when there is one.
int DefaultThreadCount();

// The cores a cgroup CPU quota allows, from cgroup v2's cpu.max text
// ("<quota> <period>", or "max <period>" for none): ceil(quota / period), at
// least 1; nullopt without a quota or for text of another form.
std::optional<int> CoresOfCpuMax(absl::string_view cpu_max);

// The thread count of one of `processes` processes sharing this host's cores
// equally: max(1, DefaultThreadCount() / processes).
int ShareOfCores(int processes);

}  // namespace himoe

#endif  // HIMOE_COMMON_CPU_CORES_H_
