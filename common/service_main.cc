#include "common/service_main.h"

#include <glog/logging.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "common/compute_setup.h"
#include "common/metrics_endpoint.h"
#include "common/program.h"
#include "common/signals.h"
#include "common/status_macros.h"

namespace himoe {
namespace service_internal {

const ServiceFlagHelp* g_flag_help = nullptr;  // set by InitService, before parsing

// Called when --help prints: abseil calls a help text that is not a constant
// when it is needed.
std::string FlagHelp(std::string ServiceFlagHelp::*field, const char* shared) {
  if (g_flag_help != nullptr && !(g_flag_help->*field).empty()) return g_flag_help->*field;
  return shared;
}

}  // namespace service_internal
}  // namespace himoe

using himoe::ServiceFlagHelp;
using himoe::service_internal::FlagHelp;

ABSL_FLAG(int, threads, 0,
          FlagHelp(&ServiceFlagHelp::threads, "torch intra-op threads; 0 = all cores"));
ABSL_FLAG(bool, blas_probe, true,
          FlagHelp(&ServiceFlagHelp::blas_probe,
                   "with BLIS and no BLIS_ARCH_TYPE set: time the kernel sets this CPU supports "
                   "and keep the fastest"));
ABSL_FLAG(int, metrics_port, -1,
          FlagHelp(&ServiceFlagHelp::metrics_port,
                   "Prometheus /metrics port; 0 picks a free one, -1 disables metrics"));
ABSL_FLAG(std::string, metrics_address, "0.0.0.0",
          FlagHelp(&ServiceFlagHelp::metrics_address, "interface of the metrics endpoint"));
ABSL_FLAG(std::string, tls_ca, "",
          FlagHelp(&ServiceFlagHelp::tls_ca,
                   "mutual TLS: PEM of the CA that signs every peer (with --tls_cert, "
                   "--tls_key; all empty = plaintext)"));
ABSL_FLAG(std::string, tls_cert, "", "mutual TLS: PEM certificate (chain) of this process");
ABSL_FLAG(std::string, tls_key, "", "mutual TLS: PEM private key of --tls_cert");

namespace himoe {

ServiceFlags GetServiceFlags() {
  ServiceFlags flags;
  flags.threads = absl::GetFlag(FLAGS_threads);
  flags.blas_probe = absl::GetFlag(FLAGS_blas_probe);
  flags.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  flags.metrics_address = absl::GetFlag(FLAGS_metrics_address);
  flags.tls = TlsFiles{absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert),
                       absl::GetFlag(FLAGS_tls_key)};
  return flags;
}

void InitService(int argc, char** argv, const ServiceInfo& info) {
  static ServiceFlagHelp help;
  help = info.flag_help;
  service_internal::g_flag_help = &help;
  InitProgram(argc, argv, info.usage);
  if (std::getenv("GLOG_logtostderr") == nullptr && std::getenv("GLOG_log_dir") == nullptr) {
    FLAGS_logtostderr = true;
  }
  google::InitGoogleLogging(argv[0]);
}

absl::Status ConfigureServiceCompute() {
  return ConfigureServingCompute(absl::GetFlag(FLAGS_threads), absl::GetFlag(FLAGS_blas_probe));
}

absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartServiceMetrics(int port) {
  if (port < 0) return nullptr;
  HIMOE_ASSIGN_OR_RETURN(
      std::unique_ptr<prometheus::Exposer> exposer,
      StartMetricsEndpoint("--metrics_port", absl::GetFlag(FLAGS_metrics_address), port));
  return exposer;
}

int WaitUntilStopSignal() {
  int sig = 0;
  while ((sig = WaitForStopSignal(std::chrono::milliseconds(500))) == 0) {
  }
  return sig;
}

int ServiceExitCode(const ServiceInfo& info, const absl::Status& status) {
  if (status.ok()) return 0;
  LOG(ERROR) << info.name << ": " << status;
  return 1;
}

}  // namespace himoe
