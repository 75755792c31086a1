#ifndef HIMOE_DEPLOY_LOCAL_LOCAL_CLUSTER_H_
#define HIMOE_DEPLOY_LOCAL_LOCAL_CLUSTER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace himoe::local {

class ChildProcess;

struct ExpertProcessOptions {
  // himoe-expert; empty = next to this executable or in the build tree.
  std::string binary;
  int num_groups = 1;
  int num_experts = 1;
  int num_layers = 1;  // MoE layers
  int64_t d_model = 0;
  int64_t d_ff = 0;
  uint64_t seed = 0;
  std::string dtype = "float32";
  std::string device = "cpu";
  int threads = 0;  // torch threads per process; 0 = all cores
  std::string log_dir;  // empty = a fresh directory under /tmp
  std::chrono::seconds ready_timeout{60};
  // Prometheus /metrics of group g on 127.0.0.1:(metrics_port_base + g); 0 =
  // a port each picks; -1 = none. Only LocalExpertCluster reads it.
  int metrics_port_base = -1;
};

// M himoe-expert processes on 127.0.0.1 (ports picked by the services),
// started, waited for (Info answers), and stopped (SIGTERM, then SIGKILL)
// by this object on every path, including when this process dies.
//
// The processes get SIGTERM when the thread that called Start() ends
// (PR_SET_PDEATHSIG), so call Start() from a thread that outlives the cluster
// (the main thread). Start() is safe in a multi-threaded process: between
// fork and exec the child makes only async-signal-safe calls.
// The log directory holds expert-<g>.log (headed by the command line), and
// expert-<g>.pid / expert-<g>.port while the processes run.
class LocalExpertCluster {
 public:
  static absl::StatusOr<std::unique_ptr<LocalExpertCluster>> Start(
      const ExpertProcessOptions& options);
  ~LocalExpertCluster();  // Stop()

  const std::vector<std::string>& addresses() const { return addresses_; }
  // "127.0.0.1:port" of each group's /metrics; empty without metrics_port_base.
  const std::vector<std::string>& metrics_addresses() const { return metrics_addresses_; }
  const std::vector<int>& pids() const { return pids_; }
  const std::string& log_dir() const { return log_dir_; }
  // An error naming the group if one of the processes has exited.
  absl::Status CheckAlive();
  void Stop();

 private:
  LocalExpertCluster() = default;

  std::vector<std::string> addresses_;
  std::vector<std::string> metrics_addresses_;
  std::vector<int> pids_;
  std::vector<ChildProcess> children_;  // group g = children_[g]
  std::string log_dir_;
  bool stopped_ = false;
};

// --- The pieces LocalExpertCluster is made of (also used by himoe-cluster) ---

// One child process: fork + exec with stdin from /dev/null and stdout/stderr
// to a log file (truncated, then headed by the command line). The child stays
// in this process group and gets SIGTERM when the spawning thread ends
// (PR_SET_PDEATHSIG). Signals go only to a child not yet reaped, so a
// recycled pid is never signalled. The destructor (and assigning over it)
// SIGKILLs and reaps a child still running.
class ChildProcess {
 public:
  // `name` is how messages call it ("expert group 0"); `pid_file`, if not
  // empty, gets the pid once spawned.
  ChildProcess(std::string name, std::string log_path, std::string pid_file = "");
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  // argv[0] is the path of the executable. Safe in a multi-threaded process.
  absl::Status Spawn(const std::vector<std::string>& argv);

  const std::string& name() const { return name_; }
  const std::string& log_path() const { return log_path_; }
  const std::string& pid_file() const { return pid_file_; }
  int pid() const { return pid_; }  // -1 before Spawn
  bool started() const { return pid_ > 0; }

  // Reaps the child if it has ended, without blocking; true once it has ended
  // (now or before).
  bool Reap();
  bool exited() const { return exited_; }
  int wait_status() const { return wait_status_; }
  // "exited with code 1", "was killed by signal 9 (Killed)".
  std::string DescribeExit() const;
  // The last `lines` lines of the log, each as "    | line\n".
  std::string LogTail(int lines = 20) const;

  void Terminate();  // SIGTERM, unless it has ended
  void Kill();       // SIGKILL, unless it has ended; then reaps it (blocking)

 private:
  std::string name_, log_path_, pid_file_;
  int pid_ = -1;
  bool exited_ = false;
  int wait_status_ = 0;
};

// Waits `d` between polls; returns true to cut the remaining wait short (the
// launcher: a second Ctrl-C). SleepPause sleeps and never cuts short.
using PauseFn = std::function<bool(std::chrono::milliseconds)>;
bool SleepPause(std::chrono::milliseconds d);

// Polls until every child has ended (true), or until `deadline` or `pause`
// cutting short (false).
bool WaitForExit(const std::vector<ChildProcess*>& children,
                 std::chrono::steady_clock::time_point deadline, const PauseFn& pause);

// SIGTERM to every child still running, waits for them until `deadline`, then
// SIGKILLs (after calling `on_kill`, if set) and reaps the rest.
void StopChildren(const std::vector<ChildProcess*>& children,
                  std::chrono::steady_clock::time_point deadline, const PauseFn& pause,
                  const std::function<void(const ChildProcess&)>& on_kill = nullptr);

// A service to wait for: `probe` answers OK once it is ready, else what is
// still missing ("no port file yet", "Info: connection refused").
struct ReadyTarget {
  ChildProcess* child = nullptr;
  std::string address;  // for messages; empty = not known yet
  std::function<absl::Status()> probe;
};

// Probes every target (a round every `poll`) until all are ready. Fails as
// soon as one of `watched` has ended (Unavailable: its name, how it ended and
// its log tail), at `deadline` (DeadlineExceeded: each target not ready, its
// last probe and log tail; `timeout` is the figure the message quotes), or
// when `pause` cuts short (Cancelled).
absl::Status WaitUntilReady(std::vector<ReadyTarget>& targets,
                            const std::vector<ChildProcess*>& watched,
                            std::chrono::steady_clock::time_point deadline,
                            std::chrono::seconds timeout, std::chrono::milliseconds poll,
                            const PauseFn& pause);

// The port file himoe-expert and himoe-router write once serving:
// "<grpc port>[ <metrics port>]". nullopt while it is absent (or lacks the
// metrics port, when `want_metrics_port`).
struct ServicePorts {
  int port = 0;
  int metrics_port = 0;  // 0 = none
};
std::optional<ServicePorts> ReadPortFile(const std::string& path, bool want_metrics_port = false);

// A channel for readiness probes: quick reconnects, a subchannel of its own.
std::shared_ptr<grpc::Channel> ProbeChannel(const std::string& target);
// One Info call (2 s deadline). OK when the himoe-expert answers as group
// `group_id` of `num_groups` with `d_model`.
absl::Status ProbeExpertInfo(const std::shared_ptr<grpc::Channel>& channel, int group_id,
                             int num_groups, int64_t d_model);
// One Info call (2 s deadline) to a himoe-router.
absl::Status ProbeRouterInfo(const std::shared_ptr<grpc::Channel>& channel);

// The himoe-expert command line serving group `group_id` of `options`' model
// (sizes, seed, dtype, device, threads) on host:port, writing `port_file`.
std::vector<std::string> ExpertCommandLine(const std::string& binary,
                                           const ExpertProcessOptions& options, int group_id,
                                           const std::string& host, int port,
                                           const std::string& port_file);

// The executable `name` (e.g. "himoe-expert", built by target himoe_expert_main
// into <build>/<subdir>/). With `bin_dir`: bin_dir/name, bin_dir/subdir/name
// (a build tree root), bin_dir/../../subdir/name. Without: next to this
// program, then <self>/../../subdir/name (from build/deploy/local/) and
// <self>/../subdir/name (from build/trainer/). NotFound lists what was tried.
absl::StatusOr<std::string> FindBinary(const std::string& name, const std::string& subdir,
                                       const std::string& bin_dir = "");
bool IsExecutableFile(const std::string& path);
std::string AbsolutePath(const std::string& path);  // realpath, or `path` if that fails
// `dir` (created with its parents if needed) as an absolute path; empty = a
// fresh /tmp/<prefix>-XXXXXX.
absl::StatusOr<std::string> PrepareLogDir(const std::string& dir, const std::string& prefix);

}  // namespace himoe::local

#endif  // HIMOE_DEPLOY_LOCAL_LOCAL_CLUSTER_H_
