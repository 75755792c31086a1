#include "common/process_stats.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace himoe {

absl::StatusOr<int64_t> PeakRssBytes(int pid) {
  const std::string path =
      pid == 0 ? "/proc/self/status" : absl::StrCat("/proc/", pid, "/status");
  std::ifstream status(path);
  if (!status) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::string line;
  while (std::getline(status, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "VmHWM:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    int64_t kib = 0;
    if (absl::ConsumeSuffix(&rest, "kB") &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kib)) {
      return kib * 1024;
    }
    return absl::DataLossError(absl::StrCat(path, ": unreadable VmHWM line '", line, "'"));
  }
  return absl::NotFoundError(absl::StrCat(path, " has no VmHWM line"));
}

namespace {

// The fields of /proc/<pid>/stat after "pid (comm) ": comm may hold spaces
// and parentheses, so they are counted after its last ')'. fields[0] is
// field 3 (state).
absl::StatusOr<std::vector<std::string>> StatFields(int pid) {
  const std::string path = pid == 0 ? "/proc/self/stat" : absl::StrCat("/proc/", pid, "/stat");
  std::ifstream stat(path);
  std::string text;
  if (!stat || !std::getline(stat, text)) {
    return absl::NotFoundError(absl::StrCat("cannot read ", path));
  }
  const std::string::size_type paren = text.rfind(')');
  std::vector<std::string> fields =
      absl::StrSplit(paren == std::string::npos ? "" : text.substr(paren + 2), ' ');
  if (fields.size() < 20) {
    return absl::DataLossError(absl::StrCat(path, ": ", fields.size(), " fields, expected >= 22"));
  }
  return fields;
}

// Field `n` (1-based, as proc(5) numbers them) as clock ticks.
absl::StatusOr<int64_t> StatTicks(int pid, const std::vector<std::string>& fields, int n) {
  int64_t ticks = 0;
  if (!absl::SimpleAtoi(fields[n - 3], &ticks)) {
    return absl::DataLossError(absl::StrCat("/proc/", pid == 0 ? "self" : absl::StrCat(pid),
                                            "/stat: field ", n, " is '", fields[n - 3], "'"));
  }
  return ticks;
}

}  // namespace

absl::StatusOr<double> SecondsSinceProcessStart(int pid) {
  HIMOE_ASSIGN_OR_RETURN(const std::vector<std::string> fields, StatFields(pid));
  HIMOE_ASSIGN_OR_RETURN(const int64_t start_ticks, StatTicks(pid, fields, 22));
  std::ifstream uptime_file("/proc/uptime");
  double uptime = 0;
  if (!(uptime_file >> uptime)) return absl::NotFoundError("cannot read /proc/uptime");
  return uptime - static_cast<double>(start_ticks) / sysconf(_SC_CLK_TCK);
}

absl::StatusOr<double> CpuSeconds(int pid) {
  HIMOE_ASSIGN_OR_RETURN(const std::vector<std::string> fields, StatFields(pid));
  HIMOE_ASSIGN_OR_RETURN(const int64_t user, StatTicks(pid, fields, 14));
  HIMOE_ASSIGN_OR_RETURN(const int64_t system, StatTicks(pid, fields, 15));
  return static_cast<double>(user + system) / sysconf(_SC_CLK_TCK);
}

CpuMeter::CpuMeter(std::vector<int> pids)
    : pids_(std::move(pids)), cpu_seconds_(pids_.size(), 0.0), started_cpu_(pids_.size()) {}

absl::Status CpuMeter::Start() {
  if (running_) return absl::FailedPreconditionError("CpuMeter::Start: already running");
  for (size_t i = 0; i < pids_.size(); ++i) {
    HIMOE_ASSIGN_OR_RETURN(started_cpu_[i], CpuSeconds(pids_[i]));
  }
  started_ = std::chrono::steady_clock::now();
  running_ = true;
  return absl::OkStatus();
}

absl::Status CpuMeter::Stop() {
  if (!running_) return absl::FailedPreconditionError("CpuMeter::Stop: not running");
  wall_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  running_ = false;
  for (size_t i = 0; i < pids_.size(); ++i) {
    HIMOE_ASSIGN_OR_RETURN(const double now, CpuSeconds(pids_[i]));
    cpu_seconds_[i] += now - started_cpu_[i];
  }
  return absl::OkStatus();
}

StartupTimer::StartupTimer() : last_(std::chrono::steady_clock::now()) {
  const absl::StatusOr<double> since_exec = SecondsSinceProcessStart();
  phases_.emplace_back("libraries", since_exec.ok() ? std::max(0.0, *since_exec) : 0.0);
}

void StartupTimer::Mark(std::string phase) {
  const auto now = std::chrono::steady_clock::now();
  phases_.emplace_back(std::move(phase), std::chrono::duration<double>(now - last_).count());
  last_ = now;
}

double StartupTimer::total_seconds() const {
  double total = 0;
  for (const auto& [phase, seconds] : phases_) total += seconds;
  return total;
}

std::string StartupTimer::Summary() const {
  std::vector<std::string> parts;
  for (const auto& [phase, seconds] : phases_) {
    parts.push_back(absl::StrFormat("%s %.2f s", phase, seconds));
  }
  return absl::StrFormat("ready %.2f s after exec: %s", total_seconds(),
                         absl::StrJoin(parts, ", "));
}

}  // namespace himoe
