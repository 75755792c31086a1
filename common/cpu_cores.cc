#include "common/cpu_cores.h"

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace himoe {
namespace {

std::string ReadSmallFile(const char* path) {
  std::ifstream in(path);
  std::string text;
  std::getline(in, text);
  return text;
}

// The quota of this process's cgroup (a container sees its own at the root).
std::optional<int> CgroupCpuLimit() {
  if (auto v2 = CoresOfCpuMax(ReadSmallFile("/sys/fs/cgroup/cpu.max"))) return v2;
  const std::string quota = ReadSmallFile("/sys/fs/cgroup/cpu/cpu.cfs_quota_us");
  const std::string period = ReadSmallFile("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
  if (quota.empty() || period.empty() || absl::StartsWith(quota, "-")) return std::nullopt;
  return CoresOfCpuMax(absl::StrCat(quota, " ", period));
}

}  // namespace

std::optional<int> CoresOfCpuMax(absl::string_view cpu_max) {
  const std::vector<absl::string_view> parts =
      absl::StrSplit(absl::StripAsciiWhitespace(cpu_max), ' ', absl::SkipEmpty());
  int64_t quota = 0, period = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &quota) ||
      !absl::SimpleAtoi(parts[1], &period) || quota <= 0 || period <= 0) {
    return std::nullopt;
  }
  return static_cast<int>(std::max<int64_t>(1, (quota + period - 1) / period));
}

int DefaultThreadCount() {
  int cores = 0;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  if (cores <= 0) cores = static_cast<int>(std::thread::hardware_concurrency());
  if (cores <= 0) cores = 1;
  static const std::optional<int> limit = CgroupCpuLimit();
  return limit.has_value() ? std::min(cores, *limit) : cores;
}

int ShareOfCores(int processes) {
  return std::max(1, DefaultThreadCount() / std::max(1, processes));
}

}  // namespace himoe
