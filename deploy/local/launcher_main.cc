// himoe-cluster: starts a whole cluster file on this machine with one command.
//
// For each expert group of the cluster file it starts a himoe-expert, waits
// until every group answers its Info RPC, then starts himoe-router and waits
// for it the same way, prints the endpoints and stays in the foreground until
// Ctrl-C (SIGINT) or SIGTERM, or until one of the services dies. Then it stops
// all of them (SIGTERM, up to 10 s, then SIGKILL) and reaps them.
//
// Exit codes: 0 stopped by a signal; 1 a service failed (did not become ready,
// or died); 2 the command line or the cluster file is refused (nothing was
// started).

#include <arpa/inet.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cluster_config.h"
#include "common/expert_shape.h"
#include "common/host_port.h"
#include "common/program.h"
#include "common/shared_memory.h"
#include "common/signals.h"
#include "common/status_macros.h"
#include "deploy/local/local_cluster.h"
#include "deploy/local/process_set.h"
#include "proto/tls_credentials.h"

ABSL_FLAG(std::string, cluster, "", "Cluster file (protobuf text format), required");
ABSL_FLAG(std::string, bin_dir, "",
          "Directory holding himoe-expert and himoe-router (or the build tree root); "
          "default: next to this program, then the build tree around it");
ABSL_FLAG(std::string, log_dir, "",
          "Where the services' logs and pid files go; default: a fresh directory under /tmp");
ABSL_FLAG(int, ready_timeout_s, 60,
          "Seconds to wait for every service to answer its Info RPC");

namespace himoe::launcher {
namespace {

constexpr int kExitSignal = 0;
constexpr int kExitFailed = 1;
constexpr int kExitRefused = 2;  // (also himoe::InitProgram's on a positional argument)
constexpr auto kStopGrace = std::chrono::seconds(10);
constexpr auto kRouterStopShare = std::chrono::seconds(5);
// A round reads the port files and asks only services with one for Info:
// cheap, so polled often (start-up is most of a restart's downtime).
constexpr auto kReadyPoll = std::chrono::milliseconds(20);
constexpr auto kServePoll = std::chrono::milliseconds(500);

using Clock = std::chrono::steady_clock;

// The interface a service's /metrics binds, from the host it serves on: a
// loopback service keeps its metrics on loopback too.
std::string MetricsHost(const std::string& host) {
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return host;
  return host == "::" ? "0.0.0.0" : "127.0.0.1";
}

std::string MetricsUrl(const std::string& metrics_host, int port) {
  return absl::StrCat("http://", JoinHostPort(DialHost(metrics_host), port), "/metrics");
}

// How a readiness wait ended.
enum class Wait { kReady, kSignal, kFailed };

struct Launcher {
  v1::ClusterConfig cluster;
  std::string cluster_path;
  std::string expert_bin, router_bin;
  std::vector<HostPort> group_hosts;
  std::vector<std::string> group_metrics_hosts;  // the interface of each group's /metrics
  std::vector<std::string> group_metrics_urls;   // empty = no metrics
  HostPort router_host;
  std::string router_address;  // as the router will listen
  std::string metrics_host;    // the interface of the router's /metrics
  std::string log_dir;
  local::ServiceSet services;  // groups in order, then the router
  int stop_signal = 0;
  Clock::time_point ready_deadline;

  // Waits up to `d` for a stop signal; true (and remembered) if one came.
  bool PauseForSignal(std::chrono::milliseconds d) {
    if (const int sig = WaitForStopSignal(d); sig != 0) {
      stop_signal = sig;
      return true;
    }
    return false;
  }

  // Waits until every service started is ready; a service that dies or is
  // not ready in time is reported with the end of its log.
  Wait WaitReady() {
    const absl::Status status = services.WaitUntilReady(
        ready_deadline, std::chrono::seconds(absl::GetFlag(FLAGS_ready_timeout_s)), kReadyPoll,
        [this](std::chrono::milliseconds d) { return PauseForSignal(d); });
    if (status.ok()) return Wait::kReady;
    if (absl::IsCancelled(status)) return Wait::kSignal;
    std::fprintf(stderr, "himoe-cluster: %s", std::string(status.message()).c_str());
    return Wait::kFailed;
  }

  bool StartService(local::ServiceSpec spec) {
    if (absl::Status s = services.Start(std::move(spec)); !s.ok()) {
      std::fprintf(stderr, "himoe-cluster: %s\n", std::string(s.message()).c_str());
      return false;
    }
    return true;
  }

  local::ServiceSpec ExpertSpec(int g) {
    const v1::GroupSpec& group = cluster.groups(g);
    local::ExpertProcessOptions o;
    o.shape = ExpertShapeFromCluster(cluster);
    o.device = group.device();
    o.threads = ServiceThreads(cluster, group.threads());
    o.tls = ClusterTls(cluster);
    o.trainer_identity = cluster.tls().trainer().identity();
    o.router_identity = cluster.tls().router().identity();
    o.shared_memory = cluster.router().shared_memory();
    local::ExpertSite site;
    site.group_id = g;
    site.host = group_hosts[g].host;
    site.port = group_hosts[g].port;
    site.address = group.address();
    site.dial_host = DialHost(group_hosts[g].host);
    site.log_dir = log_dir;
    if (group.metrics_port() > 0) {
      site.metrics_port = group.metrics_port();
      site.metrics_host = group_metrics_hosts[g];
    }
    return local::ExpertServiceSpec(expert_bin, o, site);
  }

  Wait StartExperts() {
    for (int g = 0; g < cluster.groups_size(); ++g) {
      const int metrics_port = cluster.groups(g).metrics_port();
      group_metrics_urls.push_back(
          metrics_port > 0 ? MetricsUrl(group_metrics_hosts[g], metrics_port) : "");
      if (!StartService(ExpertSpec(g))) return Wait::kFailed;
    }
    return WaitReady();
  }

  Wait StartRouter() {
    local::ServiceSpec spec;
    spec.name = "router";
    spec.log_path = absl::StrCat(log_dir, "/router.log");
    spec.pid_file = absl::StrCat(log_dir, "/router.pid");
    spec.port_file = absl::StrCat(log_dir, "/router.port");
    spec.argv = {
        router_bin,
        absl::StrCat("--cluster=", cluster_path),
        absl::StrCat("--address=", router_address),
        absl::StrCat("--threads=", ServiceThreads(cluster, cluster.router().threads())),
        absl::StrCat("--port_file=", spec.port_file),
        absl::StrCat("--metrics_port=", cluster.router().metrics_port()),
        absl::StrCat("--metrics_address=", metrics_host),
    };
    spec.address = router_address;
    spec.dial_host = DialHost(router_host.host);
    // The router reads its files from --cluster; the launcher probes it as it.
    spec.tls = ClusterTls(cluster, TlsFiles(), ClusterRole::kRouter);
    spec.want_metrics_port = true;
    spec.probe = local::ProbeRouterInfo;
    spec.stop_first = true;  // so that the groups have no client left when they stop
    if (!StartService(std::move(spec))) return Wait::kFailed;
    return WaitReady();
  }

  void PrintTable() {
    const v1::ModelSpec& m = cluster.model();
    std::string out = absl::StrFormat(
        "himoe-cluster: %s: %d groups x %d experts, %d layers, d_model %d, d_ff %d, "
        "routing %s/%s, top_k %d\n",
        cluster_path, m.num_groups(), m.num_experts() / m.num_groups(), m.num_layers(),
        m.d_model(), m.d_ff(), cluster.routing().method(), cluster.routing().preset(),
        m.top_k());
    constexpr char kRow[] = "  %-8s %-24s %-8s %-32s %s\n";
    absl::StrAppendFormat(&out, kRow, "group", "address", "pid", "metrics", "log");
    for (int g = 0; g < cluster.groups_size(); ++g) {
      const local::ServiceSet::Service& s = services[g];
      absl::StrAppendFormat(&out, kRow, absl::StrCat(g), s.address, absl::StrCat(s.process.pid()),
                            group_metrics_urls[g].empty() ? "-" : group_metrics_urls[g],
                            s.process.log_path());
    }
    const local::ServiceSet::Service& router = services[services.size() - 1];
    absl::StrAppendFormat(&out, kRow, "router", JoinHostPort(router_host.host, router.ports->port),
                          absl::StrCat(router.process.pid()),
                          MetricsUrl(metrics_host, router.ports->metrics_port),
                          router.process.log_path());
    absl::StrAppend(&out, "himoe-cluster: ready. Ctrl-C to stop.\n");
    std::fputs(out.c_str(), stdout);
    std::fflush(stdout);
  }

  // Runs until a stop signal (0) or a dead service (1).
  int Serve() {
    while (true) {
      if (PauseForSignal(kServePoll)) return kExitSignal;
      const absl::Status alive = services.CheckAlive();
      if (alive.ok()) continue;
      // A Ctrl-C from the terminal reaches the services too: if our own
      // signal is pending, this is a stop, not a failure.
      if (const int sig = PendingStopSignal(); sig != 0) {
        stop_signal = sig;
        return kExitSignal;
      }
      std::fprintf(stderr, "himoe-cluster: stopping the cluster: %s",
                   std::string(alive.message()).c_str());
      return kExitFailed;
    }
  }

  // SIGTERM, then up to kStopGrace (router first), then SIGKILL for
  // stragglers; reaps every service. A second stop signal skips the grace.
  void StopAll() {
    bool hurry = false;
    local::StopOptions options;
    options.grace = kStopGrace;
    options.first_share = kRouterStopShare;
    options.pause = [&hurry](std::chrono::milliseconds d) {
      if (!hurry && WaitForStopSignal(d) != 0) {
        std::fprintf(stderr, "himoe-cluster: second stop signal: killing everything now\n");
        hurry = true;
      }
      return hurry;
    };
    options.on_kill = [](const local::ChildProcess& c) {
      std::fprintf(stderr, "himoe-cluster: %s (pid %d) did not stop in time: SIGKILL\n",
                   c.name().c_str(), c.pid());
    };
    services.Stop(options);
  }

  // Starts everything, serves, stops; the exit code.
  int Run() {
    std::printf("himoe-cluster: logs in %s\n", log_dir.c_str());
    std::fflush(stdout);
    ready_deadline = Clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_ready_timeout_s));
    Wait wait = StartExperts();
    if (wait == Wait::kReady) wait = StartRouter();
    int code = kExitFailed;
    if (wait == Wait::kReady) {
      PrintTable();
      code = Serve();
    } else if (wait == Wait::kSignal) {
      code = kExitSignal;
    }
    if (stop_signal != 0) {
      std::printf("himoe-cluster: %s received, stopping\n", strsignal(stop_signal));
    } else {
      std::printf("himoe-cluster: stopping\n");
    }
    std::fflush(stdout);
    StopAll();
    // A router killed (by us after the grace, or by anything before) could
    // not unlink its regions.
    if (const OrphanedSharedMemory left = RemoveOrphanedSharedMemory(); left.regions > 0) {
      std::printf("himoe-cluster: removed %d shared-memory region(s), %.1f MiB, that ended "
                  "processes left in /dev/shm\n",
                  left.regions, static_cast<double>(left.bytes) / (1 << 20));
    }
    std::printf("himoe-cluster: stopped (logs in %s)\n", log_dir.c_str());
    std::fflush(stdout);
    return code;
  }
};

// --- Validation: everything that refuses the command line or the cluster
// file, before any process or directory is created. ---------------------------

absl::Status Refused(const std::string& path, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", message));
}

// One machine: two services on the same port cannot both listen.
class PortBook {
 public:
  explicit PortBook(std::string path) : path_(std::move(path)) {}

  absl::Status Claim(int port, const std::string& field) {
    for (const auto& [used, other] : used_) {
      if (used == port) {
        return Refused(path_,
                       absl::StrCat(field, " uses port ", port, ", which ", other, " uses too"));
      }
    }
    used_.emplace_back(port, field);
    return absl::OkStatus();
  }

 private:
  std::string path_;
  std::vector<std::pair<int, std::string>> used_;  // (port, field)
};

absl::Status ValidateGroup(Launcher& l, int g, const std::string& path, PortBook& ports) {
  const v1::GroupSpec& group = l.cluster.groups(g);
  const std::string field = absl::StrCat("groups[", g, "].address");
  absl::StatusOr<HostPort> hp = ParseHostPort(field, group.address());
  if (!hp.ok()) return Refused(path, hp.status().message());
  if (!IsLocalHost(hp->host)) {
    return Refused(path, absl::StrCat(
        field, " is ", group.address(),
        ", which is not on this machine; himoe-cluster only starts local groups "
        "(127.x.x.x, localhost, 0.0.0.0). Start himoe-expert on that machine instead "
        "(himoe-expert --group_id=", g, " --num_groups=", l.cluster.model().num_groups(),
        " ...), or use a loopback address here"));
  }
  if (hp->port == 0) {
    return Refused(path, absl::StrCat(field, " needs a fixed port (the router dials it), not 0"));
  }
  HIMOE_RETURN_IF_ERROR(ports.Claim(hp->port, field));
  const int metrics = group.metrics_port();
  if (metrics < 0 || metrics > 65535) {
    return Refused(path, absl::StrCat("groups[", g, "].metrics_port ", metrics,
                                      " is out of range (0 = none)"));
  }
  if (metrics != 0) {
    HIMOE_RETURN_IF_ERROR(ports.Claim(metrics, absl::StrCat("groups[", g, "].metrics_port")));
  }
  for (const std::string& replica : group.replicas()) {
    std::fprintf(stderr,
                 "himoe-cluster: note: groups[%d] replica %s is not started by this "
                 "launcher; the router fails over to it if something serves there\n",
                 g, replica.c_str());
  }
  l.group_hosts.push_back(*hp);
  l.group_metrics_hosts.push_back(MetricsHost(hp->host));
  return absl::OkStatus();
}

absl::Status ValidateRouter(Launcher& l, const std::string& path, PortBook& ports) {
  l.router_address =
      l.cluster.router().address().empty() ? "0.0.0.0:50050" : l.cluster.router().address();
  absl::StatusOr<HostPort> router = ParseHostPort("router.address", l.router_address);
  if (!router.ok()) return Refused(path, router.status().message());
  if (!IsLocalHost(router->host)) {
    return Refused(path, absl::StrCat(
        "router.address is ", l.router_address,
        ", which is not on this machine; himoe-cluster only starts a local router "
        "(127.x.x.x, localhost, 0.0.0.0). Start himoe-router on that machine instead"));
  }
  if (router->port != 0) HIMOE_RETURN_IF_ERROR(ports.Claim(router->port, "router.address"));
  l.router_host = *router;
  l.metrics_host = MetricsHost(router->host);
  const int metrics = l.cluster.router().metrics_port();
  if (metrics < 0 || metrics > 65535) {
    return Refused(path, absl::StrCat("router.metrics_port ", metrics, " is out of range"));
  }
  if (metrics != 0) HIMOE_RETURN_IF_ERROR(ports.Claim(metrics, "router.metrics_port"));
  return absl::OkStatus();
}

absl::Status Validate(Launcher& l) {
  const std::string path = absl::GetFlag(FLAGS_cluster);
  if (path.empty()) return absl::InvalidArgumentError("--cluster FILE is required");
  if (absl::GetFlag(FLAGS_ready_timeout_s) <= 0) {
    return absl::InvalidArgumentError("--ready_timeout_s must be > 0");
  }
  HIMOE_ASSIGN_OR_RETURN(l.cluster, LoadClusterConfig(path));
  l.cluster_path = local::AbsolutePath(path);
  PortBook ports(path);
  for (int g = 0; g < l.cluster.groups_size(); ++g) {
    HIMOE_RETURN_IF_ERROR(ValidateGroup(l, g, path, ports));
  }
  HIMOE_RETURN_IF_ERROR(ValidateRouter(l, path, ports));
  // Unreadable or malformed TLS files are refused here, naming the file,
  // rather than by every service after it started.
  for (const ClusterRole role : {ClusterRole::kExpert, ClusterRole::kRouter}) {
    if (const TlsFiles tls = ClusterTls(l.cluster, TlsFiles(), role); tls.enabled()) {
      if (absl::Status s = MakeChannelCredentials(tls).status(); !s.ok()) {
        return Refused(path, absl::StrCat("tls: ", s.message()));
      }
    }
  }
  return absl::OkStatus();
}

// The binaries and the log directory (created).
absl::Status Prepare(Launcher& l) {
  for (auto [bin, name, subdir] :
       {std::tuple{&l.expert_bin, "himoe-expert", "expert_service"},
        std::tuple{&l.router_bin, "himoe-router", "router_service"}}) {
    absl::StatusOr<std::string> found =
        local::FindBinary(name, subdir, absl::GetFlag(FLAGS_bin_dir));
    if (!found.ok()) {
      return absl::Status(found.status().code(),
                          absl::StrCat(found.status().message(), " or pass --bin_dir"));
    }
    *bin = *std::move(found);
  }
  HIMOE_ASSIGN_OR_RETURN(l.log_dir,
                         local::PrepareLogDir(absl::GetFlag(FLAGS_log_dir), "himoe-cluster"));
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  InitProgram(argc, argv,
              "Starts every expert group of a cluster file and the router on this machine.\n"
              "  himoe-cluster --cluster deploy/local/cluster.textproto",
              /*watch_children=*/true);
  Launcher l;
  if (absl::Status s = Validate(l); !s.ok()) {
    std::fprintf(stderr, "himoe-cluster: refused: %s\n", std::string(s.message()).c_str());
    return kExitRefused;
  }
  if (absl::Status s = Prepare(l); !s.ok()) {
    std::fprintf(stderr, "himoe-cluster: %s\n", std::string(s.message()).c_str());
    return kExitRefused;
  }
  return l.Run();
}

}  // namespace
}  // namespace himoe::launcher

int main(int argc, char** argv) { return himoe::launcher::Main(argc, argv); }
