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

absl::StatusOr<double> SecondsSinceProcessStart(int pid) {
  const std::string path = pid == 0 ? "/proc/self/stat" : absl::StrCat("/proc/", pid, "/stat");
  std::ifstream stat(path);
  std::string text;
  if (!stat || !std::getline(stat, text)) {
    return absl::NotFoundError(absl::StrCat("cannot read ", path));
  }
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so
  // the fields are counted after its last ')'. starttime is field 22.
  const std::string::size_type paren = text.rfind(')');
  const std::vector<std::string> fields =
      absl::StrSplit(paren == std::string::npos ? "" : text.substr(paren + 2), ' ');
  int64_t start_ticks = 0;
  if (fields.size() < 20 || !absl::SimpleAtoi(fields[19], &start_ticks)) {
    return absl::DataLossError(absl::StrCat(path, ": no start time"));
  }
  std::ifstream uptime_file("/proc/uptime");
  double uptime = 0;
  if (!(uptime_file >> uptime)) return absl::NotFoundError("cannot read /proc/uptime");
  return uptime - static_cast<double>(start_ticks) / sysconf(_SC_CLK_TCK);
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
