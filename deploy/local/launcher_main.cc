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
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <grpcpp/channel.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "common/cluster_config.h"
#include "deploy/local/local_cluster.h"

// (This file is compiled without the torch PCH: glog, which LibTorch's headers
// include, declares a FLAGS_log_dir of its own. See CMakeLists.txt.)
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
constexpr int kExitRefused = 2;
constexpr auto kStopGrace = std::chrono::seconds(10);
constexpr auto kRouterStopShare = std::chrono::seconds(5);
constexpr int kLogTailLines = 20;
constexpr auto kReadyPoll = std::chrono::milliseconds(200);

using Clock = std::chrono::steady_clock;

// --- Addresses ---------------------------------------------------------------

struct HostPort {
  std::string host;  // without IPv6 brackets
  int port = 0;
};

bool IsIpv6(const std::string& host) { return host.find(':') != std::string::npos; }

std::string JoinHostPort(const std::string& host, int port) {
  return IsIpv6(host) ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
}

absl::StatusOr<HostPort> SplitHostPort(absl::string_view field, const std::string& address) {
  HostPort hp;
  std::string port_text;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == std::string::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": '", address, "' is not [host]:port"));
    }
    hp.host = address.substr(1, close - 1);
    port_text = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": '", address, "' is not host:port"));
    }
    hp.host = address.substr(0, colon);
    port_text = address.substr(colon + 1);
  }
  if (hp.host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": '", address, "' has no host"));
  }
  if (!absl::SimpleAtoi(port_text, &hp.port) || hp.port < 0 || hp.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": '", address, "' has no valid port (0-65535)"));
  }
  return hp;
}

// Loopback or "all local interfaces": the only hosts a local launcher can serve.
bool IsLocalHost(const std::string& host) {
  if (host == "localhost") return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    const uint32_t a = ntohl(v4.s_addr);
    return (a >> 24) == 127 || a == 0;
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_LOOPBACK(&v6) || IN6_IS_ADDR_UNSPECIFIED(&v6);
  }
  return false;
}

// Where this machine reaches a service listening on `host`.
std::string DialHost(const std::string& host) {
  if (host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}


// --- Signals -------------------------------------------------------------------

extern "C" void IgnoreSignal(int) {}

// SIGINT/SIGTERM/SIGHUP/SIGCHLD are blocked in every thread (gRPC's threads
// inherit the mask) and taken synchronously with sigtimedwait. The stop
// signals get a no-op handler so that an inherited SIG_IGN cannot swallow them, SIGCHLD its
// default so that children stay waitable.
sigset_t WatchedSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  sigaddset(&set, SIGCHLD);
  return set;
}

void SetUpSignals() {
  struct sigaction action = {};
  action.sa_handler = IgnoreSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGHUP, &action, nullptr);
  action.sa_handler = SIG_DFL;
  sigaction(SIGCHLD, &action, nullptr);
  const sigset_t set = WatchedSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

// Waits up to `timeout` for a signal; returns the stop signal (SIGINT, SIGTERM,
// SIGHUP) if one came, else 0.
int WaitForSignal(std::chrono::milliseconds timeout) {
  const sigset_t set = WatchedSignals();
  timespec ts;
  ts.tv_sec = timeout.count() / 1000;
  ts.tv_nsec = (timeout.count() % 1000) * 1000000L;
  const int sig = sigtimedwait(&set, nullptr, &ts);
  return sig == SIGINT || sig == SIGTERM || sig == SIGHUP ? sig : 0;
}

// A SIGINT/SIGTERM already pending, without waiting.
int PendingStopSignal() {
  sigset_t pending;
  sigemptyset(&pending);
  if (sigpending(&pending) != 0) return 0;
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    if (sigismember(&pending, sig)) return WaitForSignal(std::chrono::milliseconds(0));
  }
  return 0;
}


// --- Services --------------------------------------------------------------------

using local::ChildProcess;

// A started service: the process (deploy/local/local_cluster.h) and where it serves.
struct Service {
  ChildProcess process;    // named "expert group <g>" or "router"
  std::string address;     // as configured
  std::string port_file;   // written by the service once it serves
  std::string metrics_url; // empty = no metrics
};

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

// SIGTERM, then up to kStopGrace (router first, so the groups have no client
// left when they stop), then SIGKILL for stragglers; reaps every child. A
// second SIGINT/SIGTERM skips the grace period.
void StopAll(std::vector<Service>& services) {
  const auto deadline = Clock::now() + kStopGrace;
  bool hurry = false;
  const local::PauseFn pause = [&hurry](std::chrono::milliseconds d) {
    if (!hurry && WaitForSignal(d) != 0) {
      std::fprintf(stderr, "himoe-cluster: second stop signal: killing everything now\n");
      hurry = true;
    }
    return hurry;
  };
  std::vector<ChildProcess*> routers, all;
  for (Service& s : services) {
    if (!s.process.started()) continue;
    if (s.process.name() == "router") routers.push_back(&s.process);
    all.push_back(&s.process);
  }
  for (ChildProcess* c : routers) c->Terminate();
  local::WaitForExit(routers, std::min(deadline, Clock::now() + kRouterStopShare), pause);
  local::StopChildren(all, deadline, pause, [](const ChildProcess& c) {
    std::fprintf(stderr, "himoe-cluster: %s (pid %d) did not stop in time: SIGKILL\n",
                 c.name().c_str(), c.pid());
  });
}

// How a readiness wait ended.
enum class Wait { kReady, kSignal, kFailed };

struct Launcher {
  v1::ClusterConfig cluster;
  std::string cluster_path;
  std::string expert_bin, router_bin;
  std::vector<HostPort> group_hosts;
  std::vector<std::string> group_metrics_hosts;  // the interface of each group's /metrics
  HostPort router_host;
  std::string router_address;  // as the router will listen
  std::string metrics_host;    // the interface of the router's /metrics
  std::string log_dir;
  std::vector<Service> services;  // groups in order, then the router
  int router_port = 0, metrics_port = 0;
  int stop_signal = 0;

  Clock::time_point ready_deadline;

  // Waits until every target is ready; a service that dies or is not ready in
  // time is reported with the end of its log.
  Wait WaitReady(std::vector<local::ReadyTarget>& targets) {
    std::vector<ChildProcess*> watched;
    for (Service& s : services) watched.push_back(&s.process);
    const absl::Status status = local::WaitUntilReady(
        targets, watched, ready_deadline, std::chrono::seconds(absl::GetFlag(FLAGS_ready_timeout_s)),
        kReadyPoll, [this](std::chrono::milliseconds d) {
          if (const int sig = WaitForSignal(d); sig != 0) {
            stop_signal = sig;
            return true;
          }
          return false;
        });
    if (status.ok()) return Wait::kReady;
    if (absl::IsCancelled(status)) return Wait::kSignal;
    std::fprintf(stderr, "himoe-cluster: %s", std::string(status.message()).c_str());
    return Wait::kFailed;
  }

  // Spawns `process` and adds it to `services`.
  bool StartService(Service service, const std::vector<std::string>& args) {
    std::remove(service.port_file.c_str());  // a stale one would pass for "ready"
    if (absl::Status s = service.process.Spawn(args); !s.ok()) {
      std::fprintf(stderr, "himoe-cluster: cannot start %s: %s\n",
                   service.process.name().c_str(), std::string(s.message()).c_str());
      return false;
    }
    services.push_back(std::move(service));
    return true;
  }

  Wait StartExperts() {
    const v1::ModelSpec& m = cluster.model();
    services.reserve(cluster.groups_size() + 1);
    for (int g = 0; g < cluster.groups_size(); ++g) {
      const v1::GroupSpec& group = cluster.groups(g);
      local::ExpertProcessOptions o;
      o.num_groups = m.num_groups();
      o.num_experts = m.num_experts();
      o.num_layers = m.num_layers();
      o.d_model = m.d_model();
      o.d_ff = m.d_ff();
      o.seed = m.seed();
      o.dtype = m.expert_dtype();
      o.device = group.device();
      o.threads = group.threads();
      Service s{ChildProcess(absl::StrCat("expert group ", g),
                             absl::StrCat(log_dir, "/expert-", g, ".log"),
                             absl::StrCat(log_dir, "/expert-", g, ".pid")),
                group.address(), absl::StrCat(log_dir, "/expert-", g, ".port"), ""};
      std::vector<std::string> args = local::ExpertCommandLine(
          expert_bin, o, g, group_hosts[g].host, group_hosts[g].port, s.port_file);
      if (group.metrics_port() > 0) {
        args.push_back(absl::StrCat("--metrics_port=", group.metrics_port()));
        args.push_back(absl::StrCat("--metrics_address=", group_metrics_hosts[g]));
        s.metrics_url = MetricsUrl(group_metrics_hosts[g], group.metrics_port());
      }
      if (!StartService(std::move(s), args)) return Wait::kFailed;
    }

    // Ready = our own process wrote its port file (it is the one serving, not
    // a stale process on that port) and the group answers Info as group g.
    std::vector<std::shared_ptr<grpc::Channel>> channels;
    std::vector<local::ReadyTarget> targets(cluster.groups_size());
    for (int g = 0; g < cluster.groups_size(); ++g) {
      channels.push_back(local::ProbeChannel(
          JoinHostPort(DialHost(group_hosts[g].host), group_hosts[g].port)));
      targets[g].child = &services[g].process;
      targets[g].address = services[g].address;
      targets[g].probe = [this, &channels, g]() -> absl::Status {
        if (!local::ReadPortFile(services[g].port_file)) {
          return absl::UnavailableError("no port file yet (still starting)");
        }
        return local::ProbeExpertInfo(channels[g], g, cluster.model().num_groups(),
                                      cluster.model().d_model());
      };
    }
    return WaitReady(targets);
  }

  Wait StartRouter() {
    const v1::RouterSpec& r = cluster.router();
    Service s{ChildProcess("router", absl::StrCat(log_dir, "/router.log"),
                           absl::StrCat(log_dir, "/router.pid")),
              router_address, absl::StrCat(log_dir, "/router.port"), ""};
    const std::vector<std::string> args = {
        router_bin,
        absl::StrCat("--cluster=", cluster_path),
        absl::StrCat("--address=", router_address),
        absl::StrCat("--port_file=", s.port_file),
        absl::StrCat("--metrics_port=", r.metrics_port()),
        absl::StrCat("--metrics_address=", metrics_host),
    };
    if (!StartService(std::move(s), args)) return Wait::kFailed;
    Service& router = services.back();
    std::shared_ptr<grpc::Channel> channel;
    std::vector<local::ReadyTarget> targets(1);
    targets[0].child = &router.process;
    targets[0].address = router.address;
    targets[0].probe = [&]() -> absl::Status {
      if (channel == nullptr) {
        const std::optional<local::ServicePorts> ports =
            local::ReadPortFile(router.port_file, /*want_metrics_port=*/true);
        if (!ports) return absl::UnavailableError("no port file yet (still starting)");
        router_port = ports->port;
        metrics_port = ports->metrics_port;
        router.metrics_url = MetricsUrl(metrics_host, metrics_port);
        channel = local::ProbeChannel(JoinHostPort(DialHost(router_host.host), router_port));
      }
      return local::ProbeRouterInfo(channel);
    };
    return WaitReady(targets);
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
    for (size_t i = 0; i < services.size(); ++i) {
      const Service& s = services[i];
      if (s.process.name() == "router") continue;
      absl::StrAppendFormat(&out, kRow, absl::StrCat(i), s.address, absl::StrCat(s.process.pid()),
                            s.metrics_url.empty() ? "-" : s.metrics_url, s.process.log_path());
    }
    const Service& router = services.back();
    absl::StrAppendFormat(&out, kRow, "router", JoinHostPort(router_host.host, router_port),
                          absl::StrCat(router.process.pid()), router.metrics_url,
                          router.process.log_path());
    absl::StrAppend(&out, "himoe-cluster: ready. Ctrl-C to stop.\n");
    std::fputs(out.c_str(), stdout);
    std::fflush(stdout);
  }

  // Runs until a stop signal (0) or a dead child (1).
  int Serve() {
    while (true) {
      if (int sig = WaitForSignal(std::chrono::milliseconds(500)); sig != 0) {
        stop_signal = sig;
        return kExitSignal;
      }
      for (Service& s : services) {
        ChildProcess& c = s.process;
        if (!c.exited() && c.Reap()) {
          // A Ctrl-C from the terminal reaches the services too: if our own
          // signal is pending, this is a stop, not a failure.
          if (int sig = PendingStopSignal(); sig != 0) {
            stop_signal = sig;
            return kExitSignal;
          }
          std::fprintf(stderr,
                       "himoe-cluster: %s (pid %d) %s; stopping the cluster. Last lines of "
                       "%s:\n%s",
                       c.name().c_str(), c.pid(), c.DescribeExit().c_str(),
                       c.log_path().c_str(), c.LogTail(kLogTailLines).c_str());
          return kExitFailed;
        }
      }
    }
  }
};

// Everything that refuses the command line or the cluster file, before any
// process or directory is created.
absl::Status Validate(Launcher& l) {
  const std::string path = absl::GetFlag(FLAGS_cluster);
  if (path.empty()) return absl::InvalidArgumentError("--cluster FILE is required");
  if (absl::GetFlag(FLAGS_ready_timeout_s) <= 0) {
    return absl::InvalidArgumentError("--ready_timeout_s must be > 0");
  }
  absl::StatusOr<v1::ClusterConfig> cluster = LoadClusterConfig(path);
  if (!cluster.ok()) return cluster.status();
  l.cluster = *std::move(cluster);
  l.cluster_path = local::AbsolutePath(path);

  // One machine: two services on the same port cannot both listen.
  std::vector<std::pair<int, std::string>> used;  // (port, field)
  auto check_unique = [&](const HostPort& hp, const std::string& field) -> absl::Status {
    for (const auto& [port, other] : used) {
      if (port == hp.port) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": ", field, " uses port ", hp.port, ", which ", other, " uses too"));
      }
    }
    used.emplace_back(hp.port, field);
    return absl::OkStatus();
  };
  for (int g = 0; g < l.cluster.groups_size(); ++g) {
    const std::string field = absl::StrCat("groups[", g, "].address");
    absl::StatusOr<HostPort> hp = SplitHostPort(field, l.cluster.groups(g).address());
    if (!hp.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", hp.status().message()));
    if (!IsLocalHost(hp->host)) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": ", field, " is ", l.cluster.groups(g).address(),
          ", which is not on this machine; himoe-cluster only starts local groups "
          "(127.x.x.x, localhost, 0.0.0.0). Start himoe-expert on that machine instead "
          "(himoe-expert --group_id=", g, " --num_groups=", l.cluster.model().num_groups(),
          " ...), or use a loopback address here"));
    }
    if (hp->port == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": ", field, " needs a fixed port (the router dials it), not 0"));
    }
    if (absl::Status s = check_unique(*hp, field); !s.ok()) return s;
    l.group_hosts.push_back(*hp);
    l.group_metrics_hosts.push_back(MetricsHost(hp->host));
    const int metrics = l.cluster.groups(g).metrics_port();
    if (metrics < 0 || metrics > 65535) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": groups[", g, "].metrics_port ", metrics, " is out of range (0 = none)"));
    }
    if (metrics != 0) {
      if (absl::Status s = check_unique(HostPort{hp->host, metrics},
                                        absl::StrCat("groups[", g, "].metrics_port"));
          !s.ok()) {
        return s;
      }
    }
    for (const std::string& replica : l.cluster.groups(g).replicas()) {
      std::fprintf(stderr,
                   "himoe-cluster: note: groups[%d] replica %s is not started by this "
                   "launcher; the router fails over to it if something serves there\n",
                   g, replica.c_str());
    }
  }
  l.router_address =
      l.cluster.router().address().empty() ? "0.0.0.0:50050" : l.cluster.router().address();
  absl::StatusOr<HostPort> router = SplitHostPort("router.address", l.router_address);
  if (!router.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", router.status().message()));
  }
  if (!IsLocalHost(router->host)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": router.address is ", l.router_address,
        ", which is not on this machine; himoe-cluster only starts a local router "
        "(127.x.x.x, localhost, 0.0.0.0). Start himoe-router on that machine instead"));
  }
  if (router->port != 0) {
    if (absl::Status s = check_unique(*router, "router.address"); !s.ok()) return s;
  }
  l.router_host = *router;
  // The metrics endpoint binds the router's interface: a loopback router keeps
  // its metrics on loopback too.
  l.metrics_host = MetricsHost(router->host);
  const int metrics = l.cluster.router().metrics_port();
  if (metrics < 0 || metrics > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": router.metrics_port ", metrics, " is out of range"));
  }
  if (metrics != 0) {
    if (absl::Status s = check_unique(HostPort{router->host, metrics}, "router.metrics_port");
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Starts every expert group of a cluster file and the router on this machine.\n"
      "  himoe-cluster --cluster deploy/local/cluster.textproto");
  const std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "himoe-cluster: unexpected argument '%s' (flags are --name=value)\n",
                 rest[1]);
    return kExitRefused;
  }
  SetUpSignals();

  Launcher l;
  if (absl::Status s = Validate(l); !s.ok()) {
    std::fprintf(stderr, "himoe-cluster: refused: %s\n", std::string(s.message()).c_str());
    return kExitRefused;
  }
  for (auto [bin, name, subdir] :
       {std::tuple{&l.expert_bin, "himoe-expert", "expert_service"},
        std::tuple{&l.router_bin, "himoe-router", "router_service"}}) {
    absl::StatusOr<std::string> found =
        local::FindBinary(name, subdir, absl::GetFlag(FLAGS_bin_dir));
    if (!found.ok()) {
      std::fprintf(stderr, "himoe-cluster: %s or pass --bin_dir\n",
                   std::string(found.status().message()).c_str());
      return kExitRefused;
    }
    *bin = *found;
  }
  absl::StatusOr<std::string> log_dir =
      local::PrepareLogDir(absl::GetFlag(FLAGS_log_dir), "himoe-cluster");
  if (!log_dir.ok()) {
    std::fprintf(stderr, "himoe-cluster: %s\n", std::string(log_dir.status().message()).c_str());
    return kExitRefused;
  }
  l.log_dir = *log_dir;
  std::printf("himoe-cluster: logs in %s\n", l.log_dir.c_str());
  std::fflush(stdout);

  l.ready_deadline = Clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_ready_timeout_s));
  Wait wait = l.StartExperts();
  if (wait == Wait::kReady) wait = l.StartRouter();
  int code = kExitFailed;
  if (wait == Wait::kReady) {
    l.PrintTable();
    code = l.Serve();
  } else if (wait == Wait::kSignal) {
    code = kExitSignal;
  }
  if (l.stop_signal != 0) {
    std::printf("himoe-cluster: %s received, stopping\n", strsignal(l.stop_signal));
  } else {
    std::printf("himoe-cluster: stopping\n");
  }
  std::fflush(stdout);
  StopAll(l.services);
  for (const Service& s : l.services) {  // stale once the services are gone
    std::remove(s.process.pid_file().c_str());
    std::remove(s.port_file.c_str());
  }
  std::printf("himoe-cluster: stopped (logs in %s)\n", l.log_dir.c_str());
  std::fflush(stdout);
  return code;
}

}  // namespace
}  // namespace himoe::launcher

int main(int argc, char** argv) { return himoe::launcher::Main(argc, argv); }
