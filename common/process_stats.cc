#include "common/process_stats.h"

#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
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

}  // namespace himoe
