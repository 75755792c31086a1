#ifndef HIMOE_DEPLOY_LOCAL_LOCAL_CLUSTER_H_
#define HIMOE_DEPLOY_LOCAL_LOCAL_CLUSTER_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tls_files.h"
#include "deploy/local/process_set.h"
#include "himoe/v1/model.pb.h"

namespace himoe::local {

struct ExpertProcessOptions {
  // himoe-expert; empty = next to this executable or in the build tree.
  std::string binary;
  v1::ExpertShape shape;  // validated by Start (ValidateExpertShape)
  std::string device = "cpu";
  int threads = 0;  // torch threads per process; 0 = all cores
  std::string log_dir;  // empty = a fresh directory under /tmp
  std::chrono::seconds ready_timeout{60};
  // Prometheus /metrics of group g on 127.0.0.1:(metrics_port_base + g); 0 =
  // a port each picks; -1 = none. Only LocalExpertCluster reads it.
  int metrics_port_base = -1;
  // Mutual TLS of every group's port (--tls_ca/--tls_cert/--tls_key); the
  // readiness probes dial with it too. Empty = plaintext.
  TlsFiles tls;
  // With tls: --trainer_identity / --router_identity (the roles' principals).
  std::string trainer_identity;
  std::string router_identity;
  // --shared_memory: the groups take tensors through POSIX shared memory
  // from clients on this host that send them that way (himoe-trainer's own
  // groups; himoe-cluster's with router.shared_memory).
  bool shared_memory = false;
  // --max_tokens of every group; 0 = himoe-expert's default.
  int64_t max_tokens = 0;
  // --run_state_file=<log_dir>/expert-<g>.run: a group started again serves
  // the run it kept there.
  bool run_state = false;
};

// M himoe-expert processes on 127.0.0.1 (ports picked by the services),
// started, waited for (Info answers as the group, with `shape`), and stopped
// (SIGTERM, then SIGKILL) by this object on every path, including when this
// process dies.
//
// The processes get SIGTERM when the thread that called Start() ends
// (PR_SET_PDEATHSIG), so call Start() from a thread that outlives the cluster
// (the main thread). Start() is safe in a multi-threaded process.
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
  // Starts every group process that has exited again, on its first address
  // (so clients reconnect by themselves), and waits until each serves; the
  // groups restarted (none if all run).
  absl::StatusOr<std::vector<int>> RestartExited();
  void Stop();

 private:
  LocalExpertCluster() = default;
  absl::Status StartGroups(const ExpertProcessOptions& options, const std::string& binary);

  std::vector<std::string> addresses_;
  std::vector<std::string> metrics_addresses_;
  std::vector<int> pids_;
  std::string log_dir_;
  ExpertProcessOptions options_;
  std::string binary_;
  ServiceSet services_;  // group g = services_[g]
};

// Where one himoe-expert process serves and keeps its files.
struct ExpertSite {
  int group_id = 0;
  std::string host = "127.0.0.1";  // --address=host:port
  int port = 0;                    // 0 = the service picks one
  std::string address;             // as configured, for messages; empty = dial_host:port
  std::string dial_host = "127.0.0.1";  // where this machine reaches it
  std::string log_dir;  // expert-<g>.log, .pid and .port go here
  int metrics_port = -1;  // --metrics_port; -1 = no metrics, 0 = the service picks one
  std::string metrics_host = "127.0.0.1";  // --metrics_address
};

// The one builder of a himoe-expert service: the command line (the shape's
// flags, device, threads, port file, metrics, shared memory, run state file,
// max_tokens, TLS), its files, and the readiness probe (Info answers as the
// group, with `options.shape`). `binary` is argv[0].
ServiceSpec ExpertServiceSpec(const std::string& binary, const ExpertProcessOptions& options,
                              const ExpertSite& site);

}  // namespace himoe::local

#endif  // HIMOE_DEPLOY_LOCAL_LOCAL_CLUSTER_H_
