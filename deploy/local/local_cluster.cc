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
constexpr char kLocalHost[] = "127.0.0.1";

absl::StatusOr<std::string> ExpertBinary(const std::string& binary) {
  if (binary.empty()) return FindBinary("himoe-expert", "expert_service");
  if (!IsExecutableFile(binary)) {
    return absl::NotFoundError(
        absl::StrCat("the himoe-expert binary '", binary, "' is not an executable file"));
  }
  return AbsolutePath(binary);
}

}  // namespace

std::vector<std::string> ExpertCommandLine(const std::string& binary,
                                           const ExpertProcessOptions& options, int group_id,
                                           const std::string& host, int port,
                                           const std::string& port_file) {
  const v1::ExpertShape& s = options.shape;
  std::vector<std::string> argv = {
      binary,
      absl::StrCat("--address=", JoinHostPort(host, port)),
      absl::StrCat("--group_id=", group_id),
      absl::StrCat("--num_groups=", s.num_groups()),
      absl::StrCat("--num_experts=", s.num_experts()),
      absl::StrCat("--num_layers=", s.num_layers()),
      absl::StrCat("--d_model=", s.d_model()),
      absl::StrCat("--d_ff=", s.d_ff()),
      absl::StrCat("--seed=", s.seed()),
      absl::StrCat("--dtype=", ExpertDtypeName(s.dtype())),
      absl::StrCat("--device=", options.device.empty() ? "cpu" : options.device),
      absl::StrCat("--threads=", options.threads),
      absl::StrCat("--port_file=", port_file),
  };
  if (s.matmul_dtype() == v1::DTYPE_BFLOAT16) argv.push_back("--matmul_dtype=bfloat16");
  if (s.init() != v1::WEIGHT_INIT_DEFAULT) {
    argv.push_back(absl::StrCat("--init=", WeightInitName(s.init())));
    argv.push_back(absl::StrCat("--n_layer=", s.n_layer()));
  }
  if (options.shared_memory) argv.push_back("--shared_memory");
  if (options.tls.enabled()) {
    argv.push_back(absl::StrCat("--tls_ca=", options.tls.ca_file));
    argv.push_back(absl::StrCat("--tls_cert=", options.tls.cert_file));
    argv.push_back(absl::StrCat("--tls_key=", options.tls.key_file));
  }
  return argv;
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
    ServiceSpec spec;
    spec.name = absl::StrCat("expert group ", g);
    spec.log_path = absl::StrCat(log_dir_, "/expert-", g, ".log");
    spec.pid_file = absl::StrCat(log_dir_, "/expert-", g, ".pid");
    spec.port_file = absl::StrCat(log_dir_, "/expert-", g, ".port");
    spec.argv = ExpertCommandLine(binary, options, g, kLocalHost, 0, spec.port_file);
    if (metrics) {
      spec.argv.push_back(absl::StrCat(
          "--metrics_port=", options.metrics_port_base == 0 ? 0 : options.metrics_port_base + g));
      spec.argv.push_back(absl::StrCat("--metrics_address=", kLocalHost));
    }
    spec.want_metrics_port = metrics;
    spec.dial_host = kLocalHost;
    spec.tls = options.tls;
    spec.probe = [g, shape = options.shape](const std::shared_ptr<grpc::Channel>& channel) {
      return ProbeExpertInfo(channel, g, shape);
    };
    HIMOE_RETURN_IF_ERROR(services_.Start(std::move(spec)));
  }
  HIMOE_RETURN_IF_ERROR(services_.WaitUntilReady(std::chrono::steady_clock::now() +
                                                     options.ready_timeout,
                                                 options.ready_timeout, kReadyPoll));
  for (size_t g = 0; g < services_.size(); ++g) {
    addresses_.push_back(services_[g].address);
    if (metrics) {
      metrics_addresses_.push_back(JoinHostPort(kLocalHost, services_[g].ports->metrics_port));
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
    std::vector<std::string> argv =
        ExpertCommandLine(binary_, options_, static_cast<int>(g), kLocalHost, ports.port,
                          services_[g].spec.port_file);
    if (options_.metrics_port_base >= 0) {
      argv.push_back(absl::StrCat("--metrics_port=", ports.metrics_port));
      argv.push_back(absl::StrCat("--metrics_address=", kLocalHost));
    }
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
