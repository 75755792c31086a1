#ifndef HIMOE_DEPLOY_LOCAL_PROCESS_SET_H_
#define HIMOE_DEPLOY_LOCAL_PROCESS_SET_H_

// Local service processes: spawn, port file, Info probe, watch, stop. Used by
// LocalExpertCluster (the trainer's local experts) and himoe-cluster.

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tls_files.h"
#include "himoe/v1/model.pb.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace himoe::local {

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

  // argv[0] is the path of the executable. Safe in a multi-threaded process:
  // between fork and exec the child makes only async-signal-safe calls.
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
// launcher: a stop signal). SleepPause sleeps and never cuts short.
using PauseFn = std::function<bool(std::chrono::milliseconds)>;
bool SleepPause(std::chrono::milliseconds d);

// The port file himoe-expert and himoe-router write once serving:
// "<grpc port>[ <metrics port>]". nullopt while it is absent (or lacks the
// metrics port, when `want_metrics_port`).
struct ServicePorts {
  int port = 0;
  int metrics_port = 0;  // 0 = none
};
std::optional<ServicePorts> ReadPortFile(const std::string& path, bool want_metrics_port = false);

// A channel for readiness probes: quick reconnects, a subchannel of its own;
// mutual TLS when `tls` is set (errors name a bad file).
absl::StatusOr<std::shared_ptr<grpc::Channel>> ProbeChannel(const std::string& target,
                                                            const TlsFiles& tls = TlsFiles());
// One Info call (2 s deadline). OK when the himoe-expert answers as group
// `group_id` and serves `shape` (CheckExpertShape).
absl::Status ProbeExpertInfo(const std::shared_ptr<grpc::Channel>& channel, int group_id,
                             const v1::ExpertShape& shape);
// One Info call (2 s deadline) to a himoe-router.
absl::Status ProbeRouterInfo(const std::shared_ptr<grpc::Channel>& channel);

// A service to start and wait for.
struct ServiceSpec {
  std::string name;               // in messages: "expert group 0", "router"
  std::vector<std::string> argv;  // argv[0]: the executable
  std::string log_path;
  std::string pid_file;   // optional; removed by Stop()
  std::string port_file;  // written by the service once it serves; removed by Start and Stop
  bool want_metrics_port = false;  // ready only once the port file names both ports
  std::string address;    // as configured, for messages; empty = dial_host:port once known
  std::string dial_host = "127.0.0.1";  // where this machine reaches it
  TlsFiles tls;  // how the probe dials it; empty = plaintext
  // Called once the port file is there, with a channel to dial_host:port;
  // OK = ready, else what is still missing.
  std::function<absl::Status(const std::shared_ptr<grpc::Channel>&)> probe;
  bool stop_first = false;  // stopped before the others (a client of them: the router)
};

struct StopOptions {
  std::chrono::seconds grace{10};  // SIGTERM -> SIGKILL
  // The stop_first services get SIGTERM alone and up to this long to exit.
  std::chrono::seconds first_share{5};
  PauseFn pause = SleepPause;  // cutting short skips the rest of the grace
  std::function<void(const ChildProcess&)> on_kill;  // before each SIGKILL
};

// Services started in order, waited for (port file, then `probe`), watched
// and stopped (SIGTERM, grace, SIGKILL; pid and port files removed).
class ServiceSet {
 public:
  struct Service {
    Service(ServiceSpec spec, ChildProcess process)
        : spec(std::move(spec)), process(std::move(process)) {}

    ServiceSpec spec;
    ChildProcess process;
    std::optional<ServicePorts> ports;  // from the port file, once read
    std::string address;                // spec.address, or dial_host:port once known
    bool ready = false;
    std::shared_ptr<grpc::Channel> channel;  // the probe's, until ready
  };

  ServiceSet() = default;
  ServiceSet(const ServiceSet&) = delete;
  ServiceSet& operator=(const ServiceSet&) = delete;
  ~ServiceSet();  // Stop() with the default options

  // Removes a stale port file (it would pass for "ready") and spawns; on
  // failure "cannot start <name>: ..." and nothing is added.
  absl::Status Start(ServiceSpec spec);

  // Probes every service not ready yet (a round every `poll`) until all are.
  // Fails as soon as a service has ended (Unavailable: its name, how it ended
  // and its log tail), at `deadline` (DeadlineExceeded: each service not
  // ready, its last probe and log tail; `timeout` is the figure the message
  // quotes), or when `pause` cuts short (Cancelled).
  absl::Status WaitUntilReady(std::chrono::steady_clock::time_point deadline,
                              std::chrono::seconds timeout, std::chrono::milliseconds poll,
                              const PauseFn& pause = SleepPause);

  // Unavailable naming the first service that has ended (pid, address, how it
  // ended, its log tail); OK while all run.
  absl::Status CheckAlive();

  // Indices of the services that have ended (reaped now or before).
  std::vector<size_t> Ended();
  // Starts service i again with `argv` (e.g. its first port, now known, in
  // place of port 0), after killing what is left of it; its log so far is
  // kept as <log>.previous. It is not ready until WaitUntilReady probes it.
  absl::Status Restart(size_t i, std::vector<std::string> argv);

  // Stops every service still running; idempotent.
  void Stop(const StopOptions& options = StopOptions());
  bool stopped() const { return stopped_; }

  size_t size() const { return services_.size(); }
  const Service& operator[](size_t i) const { return services_[i]; }
  std::vector<int> pids() const;

 private:
  absl::Status Probe(Service& s);

  std::vector<Service> services_;
  bool stopped_ = false;
};

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

#endif  // HIMOE_DEPLOY_LOCAL_PROCESS_SET_H_
