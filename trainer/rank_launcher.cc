#include "trainer/rank_launcher.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cpu_cores.h"
#include "common/file_util.h"
#include "common/signals.h"
#include "common/status_macros.h"
#include "deploy/local/local_cluster.h"
#include "deploy/local/process_set.h"
#include "model/checkpoint_reader.h"
#include "trainer/data_parallel.h"
#include "trainer/training_run.h"

namespace himoe::trainer {
namespace {

constexpr auto kPoll = std::chrono::milliseconds(100);
// After a rank fails, how long the others get to fail by themselves.
constexpr auto kFailureGrace = std::chrono::seconds(10);

absl::StatusOr<std::string> SelfExecutable() {
  char path[4096];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return absl::ErrnoToStatus(errno, "readlink /proc/self/exe");
  return std::string(path, n);
}

// What a child's wait status means as this program's exit code.
int ExitCode(const local::ChildProcess& child) {
  const int status = child.wait_status();
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// Copies what a log file gained since the last call to stderr.
class LogFollower {
 public:
  explicit LogFollower(std::string path) : path_(std::move(path)) {}
  void Poll() {
    std::ifstream in(path_, std::ios::binary);
    if (!in) return;
    in.seekg(0, std::ios::end);
    const std::streamoff size = in.tellg();
    if (size <= offset_) return;
    in.seekg(offset_);
    std::string chunk(static_cast<size_t>(size - offset_), '\0');
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    offset_ += in.gcount();
    std::cerr.write(chunk.data(), in.gcount());
    std::cerr.flush();
  }

 private:
  std::string path_;
  std::streamoff offset_ = 0;
};

}  // namespace

std::vector<std::string> WithoutRanksFlag(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (absl::StartsWith(a, "--ranks=") || absl::StartsWith(a, "-ranks=")) continue;
    if (a == "--ranks" || a == "-ranks") {
      ++i;  // and its value
      continue;
    }
    out.push_back(a);
  }
  return out;
}

namespace {

// How one attempt of the ranks ended.
struct Outcome {
  int code = 0;             // 0, the first failed rank's exit code, or 128 + signal
  int failed = -1;          // that rank
  int stop_signal = 0;      // a stop signal forwarded to the ranks
  std::string description;  // each failed rank's exit and the end of its log
};

// Starts the ranks (`argv` for each, then its rank and the store's port),
// follows rank 0's log and waits for all of them.
absl::StatusOr<Outcome> RunRanks(const TrainerFlags& flags, const std::vector<std::string>& argv,
                                 int port) {
  const int n = flags.ranks;
  std::vector<local::ChildProcess> ranks;
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> rank_argv = argv;
    rank_argv.push_back(absl::StrCat("--rank=", r));
    rank_argv.push_back(absl::StrCat("--master_port=", port));
    const std::string log = JoinPath(flags.out_dir, absl::StrCat("rank", r, ".log"));
    if (IsRegularFile(log)) HIMOE_RETURN_IF_ERROR(RenamePath(log, absl::StrCat(log, ".previous")));
    ranks.emplace_back(absl::StrCat("trainer rank ", r), log);
    HIMOE_RETURN_IF_ERROR(ranks.back().Spawn(rank_argv));
  }
  LogFollower follow(ranks[0].log_path());
  Outcome outcome;
  std::vector<bool> described(n, false);
  std::optional<std::chrono::steady_clock::time_point> failed_at;
  while (true) {
    if (const int sig = WaitForStopSignal(kPoll); sig != 0 && outcome.stop_signal == 0) {
      outcome.stop_signal = sig;
      for (local::ChildProcess& rank : ranks) {
        if (!rank.Reap()) kill(rank.pid(), sig);
      }
    }
    follow.Poll();
    bool running = false;
    for (int r = 0; r < n; ++r) {
      if (!ranks[r].Reap()) {
        running = true;
      } else if (!described[r] && ExitCode(ranks[r]) != 0) {
        // Every failed rank's end: the first to fail may be seen after the
        // ones its exit failed.
        described[r] = true;
        if (outcome.failed < 0) {
          outcome.failed = r;
          outcome.code = ExitCode(ranks[r]);
          failed_at = std::chrono::steady_clock::now();
        }
        absl::StrAppend(&outcome.description, outcome.description.empty() ? "" : "\n",
                        ranks[r].name(), " ", ranks[r].DescribeExit(), "; the end of ",
                        ranks[r].log_path(), ":\n", ranks[r].LogTail(2));
      }
    }
    if (!running) break;
    if (failed_at.has_value() && std::chrono::steady_clock::now() - *failed_at > kFailureGrace) {
      for (local::ChildProcess& rank : ranks) {
        if (!rank.Reap()) {
          std::cerr << "killing " << rank.name() << " (rank " << outcome.failed << " failed)\n";
          rank.Kill();
        }
      }
    }
  }
  follow.Poll();
  return outcome;
}

}  // namespace

absl::StatusOr<int> LaunchRanks(const TrainerFlags& flags, const std::vector<std::string>& args) {
  const int n = flags.ranks;
  HIMOE_RETURN_IF_ERROR(ValidateTrainerFlags(flags));
  HIMOE_ASSIGN_OR_RETURN(const TrainerOptions options, TrainerOptionsFromFlags(flags));
  HIMOE_RETURN_IF_ERROR(CreateDirectories(flags.out_dir));
  HIMOE_ASSIGN_OR_RETURN(const std::string self, SelfExecutable());

  std::unique_ptr<local::LocalExpertCluster> experts;
  std::vector<std::string> argv = {self};
  for (const std::string& a : WithoutRanksFlag(args)) {
    if (a != "--resume" && a != "--resume=true") argv.push_back(a);
  }
  int busy_cores = 0;
  if (flags.experts == "local" && flags.expert_addresses.empty()) {
    HIMOE_ASSIGN_OR_RETURN(experts, StartLocalExpertProcesses(flags, options.model));
    argv.push_back(absl::StrCat("--expert_addresses=", absl::StrJoin(experts->addresses(), ",")));
    busy_cores = flags.num_groups * std::max(1, flags.expert_threads);
    std::cerr << "experts: " << flags.num_groups << " himoe-expert processes on "
              << absl::StrJoin(experts->addresses(), ", ") << " (logs in " << experts->log_dir()
              << ")\n";
  }
  if (flags.threads == 0) {
    argv.push_back(
        absl::StrCat("--threads=", std::max(1, (DefaultThreadCount() - busy_cores) / n)));
  }
  // The launcher recovers a lost group; each rank fails (and so ends the
  // attempt) instead.
  const bool recover = experts != nullptr && WaitAndResume(flags);
  argv.push_back("--on_group_failure=fail");
  argv.push_back(absl::StrCat("--world_size=", n));
  argv.push_back("--master_addr=127.0.0.1");
  // The ranks join the store served here (torchrun's agent-store variable).
  setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  std::cerr << "ranks: " << n << " himoe-trainer processes (logs in " << flags.out_dir
            << "/rank<r>.log); rank 0's log follows\n";
  const std::string checkpoints = JoinPath(flags.out_dir, "checkpoints");
  bool resume = flags.resume;
  for (int restarts = 0;; ++restarts) {
    std::vector<std::string> attempt = argv;
    if (resume) attempt.push_back("--resume");
    // A fresh store each attempt: no key of the last one is left.
    HIMOE_ASSIGN_OR_RETURN(
        std::unique_ptr<RendezvousStore> store,
        RendezvousStore::Serve(0, n, std::chrono::seconds(std::max(1, flags.dist_timeout_s))));
    HIMOE_ASSIGN_OR_RETURN(const Outcome outcome, RunRanks(flags, attempt, store->port()));
    if (outcome.code == 0) return 0;
    const bool stopped = outcome.stop_signal != 0 && outcome.code == 128 + outcome.stop_signal;
    // A lost group is an expert process that exited.
    const absl::Status groups = experts != nullptr ? experts->CheckAlive() : absl::OkStatus();
    if (stopped || !recover || groups.ok() || restarts >= flags.max_group_restarts) {
      if (!stopped) std::cerr << "himoe-trainer: " << outcome.description << "\n";
      if (!groups.ok() && recover) {
        std::cerr << "himoe-trainer: giving up after " << restarts
                  << " recovered group failures: " << groups.message() << "\n";
      }
      return outcome.code;
    }
    std::cerr << "\nexpert group failure (" << restarts + 1 << " of at most "
              << flags.max_group_restarts << " recovered): " << groups.message() << "; "
              << outcome.description << "\n";
    HIMOE_ASSIGN_OR_RETURN(const std::vector<int> restarted, experts->RestartExited());
    std::cerr << "restarted expert group(s) " << absl::StrJoin(restarted, ", ") << "\n";
    resume = model::LatestCheckpoint(checkpoints).ok();
    std::cerr << "restarting the " << n << " ranks "
              << (resume ? "from the newest checkpoint" : "from step 0 (no checkpoint)") << "\n";
  }
}

}  // namespace himoe::trainer
