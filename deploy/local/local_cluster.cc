#include "deploy/local/local_cluster.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/expert_shape.h"
#include "common/host_port.h"
#include "common/status_macros.h"

namespace himoe::local {
namespace {

constexpr auto kStopGrace = std::chrono::seconds(10);
constexpr auto kReadyPoll = std::chrono::milliseconds(20);  // as himoe-cluster's

absl::StatusOr<std::string> ExpertBinary(const std::string& binary) {
  if (binary.empty()) return FindBinary("himoe-expert", "expert_service");
  if (!IsExecutableFile(binary)) {
    return absl::NotFoundError(
        absl::StrCat("the himoe-expert binary '", binary, "' is not an executable file"));
  }
  return AbsolutePath(binary);
}

}  // namespace

ServiceSpec ExpertServiceSpec(const std::string& binary, const ExpertProcessOptions& options,
                              const ExpertSite& site) {
  const int g = site.group_id;
  ServiceSpec spec;
  spec.name = absl::StrCat("expert group ", g);
  spec.log_path = absl::StrCat(site.log_dir, "/expert-", g, ".log");
  spec.pid_file = absl::StrCat(site.log_dir, "/expert-", g, ".pid");
  spec.port_file = absl::StrCat(site.log_dir, "/expert-", g, ".port");
  spec.argv = {binary, absl::StrCat("--address=", JoinHostPort(site.host, site.port)),
               absl::StrCat("--group_id=", g)};
  for (std::string& arg : ExpertShapeArgs(options.shape)) spec.argv.push_back(std::move(arg));
  spec.argv.push_back(absl::StrCat("--device=", options.device.empty() ? "cpu" : options.device));
  spec.argv.push_back(absl::StrCat("--threads=", options.threads));
  spec.argv.push_back(absl::StrCat("--port_file=", spec.port_file));
  if (site.metrics_port >= 0) {
    spec.argv.push_back(absl::StrCat("--metrics_port=", site.metrics_port));
    spec.argv.push_back(absl::StrCat("--metrics_address=", site.metrics_host));
  }
  if (options.shared_memory) spec.argv.push_back("--shared_memory");
  if (options.run_state) {
    spec.argv.push_back(absl::StrCat("--run_state_file=", site.log_dir, "/expert-", g, ".run"));
  }
  if (options.max_tokens > 0) {
    spec.argv.push_back(absl::StrCat("--max_tokens=", options.max_tokens));
  }
  if (options.tls.enabled()) {
    spec.argv.push_back(absl::StrCat("--tls_ca=", options.tls.ca_file));
    spec.argv.push_back(absl::StrCat("--tls_cert=", options.tls.cert_file));
    spec.argv.push_back(absl::StrCat("--tls_key=", options.tls.key_file));
  }
  if (!options.trainer_identity.empty()) {
    spec.argv.push_back(absl::StrCat("--trainer_identity=", options.trainer_identity));
  }
  if (!options.router_identity.empty()) {
    spec.argv.push_back(absl::StrCat("--router_identity=", options.router_identity));
  }
  spec.want_metrics_port = site.metrics_port >= 0;
  spec.address = site.address;
  spec.dial_host = site.dial_host;
  spec.tls = options.tls;
  spec.probe = [g, shape = options.shape](const std::shared_ptr<grpc::Channel>& channel) {
    return ProbeExpertInfo(channel, g, shape);
  };
  return spec;
}

absl::StatusOr<std::unique_ptr<LocalExpertCluster>> LocalExpertCluster::Start(
    const ExpertProcessOptions& options) {
  if (const absl::Status s = ValidateExpertShape(options.shape); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("local experts: ", s.message()));
  }
  if (options.ready_timeout.count() <= 0) {
    return absl::InvalidArgumentError("local experts: ready_timeout must be > 0");
  }
  HIMOE_ASSIGN_OR_RETURN(const std::string binary, ExpertBinary(options.binary));
  HIMOE_ASSIGN_OR_RETURN(std::string log_dir, PrepareLogDir(options.log_dir, "himoe-experts"));

  // From here on, the destructor stops whatever was started on every error path.
  std::unique_ptr<LocalExpertCluster> cluster(new LocalExpertCluster());
  cluster->log_dir_ = std::move(log_dir);
  HIMOE_RETURN_IF_ERROR(cluster->StartGroups(options, binary));
  return cluster;
}

absl::Status LocalExpertCluster::StartGroups(const ExpertProcessOptions& options,
                                             const std::string& binary) {
  options_ = options;
  binary_ = binary;
  const int m = options.shape.num_groups();
  const bool metrics = options.metrics_port_base >= 0;
  for (int g = 0; g < m; ++g) {
    ExpertSite site;
    site.group_id = g;
    site.log_dir = log_dir_;
    if (metrics) {
      site.metrics_port = options.metrics_port_base == 0 ? 0 : options.metrics_port_base + g;
    }
    HIMOE_RETURN_IF_ERROR(services_.Start(ExpertServiceSpec(binary, options, site)));
  }
  HIMOE_RETURN_IF_ERROR(services_.WaitUntilReady(std::chrono::steady_clock::now() +
                                                     options.ready_timeout,
                                                 options.ready_timeout, kReadyPoll));
  for (size_t g = 0; g < services_.size(); ++g) {
    addresses_.push_back(services_[g].address);
    if (metrics) {
      metrics_addresses_.push_back(JoinHostPort("127.0.0.1", services_[g].ports->metrics_port));
    }
  }
  pids_ = services_.pids();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int>> LocalExpertCluster::RestartExited() {
  if (services_.stopped()) {
    return absl::FailedPreconditionError("the local expert processes were stopped");
  }
  std::vector<int> restarted;
  for (const size_t g : services_.Ended()) {
    const ServicePorts& ports = *services_[g].ports;  // known: the group was ready once
    ExpertSite site;
    site.group_id = static_cast<int>(g);
    site.port = ports.port;
    site.log_dir = log_dir_;
    if (options_.metrics_port_base >= 0) site.metrics_port = ports.metrics_port;
    std::vector<std::string> argv = ExpertServiceSpec(binary_, options_, site).argv;
    HIMOE_RETURN_IF_ERROR(services_.Restart(g, std::move(argv)));
    restarted.push_back(static_cast<int>(g));
  }
  if (restarted.empty()) return restarted;
  HIMOE_RETURN_IF_ERROR(services_.WaitUntilReady(
      std::chrono::steady_clock::now() + options_.ready_timeout, options_.ready_timeout,
      kReadyPoll));
  pids_ = services_.pids();
  return restarted;
}

LocalExpertCluster::~LocalExpertCluster() { Stop(); }

absl::Status LocalExpertCluster::CheckAlive() {
  if (services_.stopped()) {
    return absl::FailedPreconditionError("the local expert processes were stopped");
  }
  return services_.CheckAlive();
}

void LocalExpertCluster::Stop() {
  StopOptions options;
  options.grace = kStopGrace;
  options.on_kill = [](const ChildProcess& c) {
    std::fprintf(stderr, "himoe: %s (pid %d) did not stop within %d s: SIGKILL\n",
                 c.name().c_str(), c.pid(), static_cast<int>(kStopGrace.count()));
  };
  services_.Stop(options);
}

}  // namespace himoe::local
