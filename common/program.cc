#include "common/program.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "common/signals.h"

namespace himoe {

void ParseCommandLine(int argc, char** argv, absl::string_view usage) {
  // Debian builds abseil without NDEBUG, so every absl::Mutex lock (gRPC's
  // included) updates a global lock-order graph, which slows every lock
  // (docs/benchmarks.md, "Measurements behind choices in the code"). Lock
  // order is checked under ThreadSanitizer instead.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(usage);
  // Abseil's default --help shows only flags of <program>.cc or
  // <program>_main.cc; our binaries (himoe-expert, ...) define theirs in
  // expert_main.cc and the like, and nowhere else.
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "_main.cc");
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  config.normalize_filename = [](absl::string_view file) {
    const size_t slash = file.rfind('/');
    return std::string(slash == absl::string_view::npos ? file : file.substr(slash + 1));
  };
  absl::SetFlagsUsageConfig(config);
  const std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "%s: unexpected argument '%s' (flags are --name=value; see --help)\n",
                 argv[0], rest[1]);
    std::exit(2);
  }
}

void InitProgram(int argc, char** argv, absl::string_view usage, bool watch_children) {
  BlockStopSignals(watch_children);
  ParseCommandLine(argc, argv, usage);
  PrintStackOnCrash();
}

}  // namespace himoe
