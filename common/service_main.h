#ifndef HIMOE_COMMON_SERVICE_MAIN_H_
#define HIMOE_COMMON_SERVICE_MAIN_H_

// What the main() of himoe-expert, himoe-router and himoe-trainer share: the
// start-up (stop signals, the command line, glog, the crash handler), the
// flags every service has and their reading, compute set-up, the /metrics
// endpoint and the port file.
//
// service_main.cc defines --threads, --blas_probe, --metrics_port,
// --metrics_address, --tls_ca, --tls_cert and --tls_key; server_main.cc
// (linked in by the gRPC servers, which call WritePortFile or
// MaxMessageBytesFlag) --port_file and --max_message_bytes.

#include <prometheus/exposer.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/tls_files.h"

namespace himoe {

// A binary's own wording of the shared flags' help, for --help; an empty
// text keeps the shared one.
struct ServiceFlagHelp {
  std::string threads;
  std::string blas_probe;
  std::string metrics_port;
  std::string metrics_address;
  std::string tls_ca;
  std::string port_file;
  std::string max_message_bytes;
};

struct ServiceInfo {
  std::string name;   // "himoe-expert": heads the message of a failed run
  std::string usage;  // heads --help
  ServiceFlagHelp flag_help;
};

// The shared flags, as given.
struct ServiceFlags {
  int threads = 0;              // --threads
  bool blas_probe = true;       // --blas_probe
  int metrics_port = -1;        // --metrics_port
  std::string metrics_address;  // --metrics_address
  TlsFiles tls;                 // --tls_ca, --tls_cert, --tls_key
};
ServiceFlags GetServiceFlags();

// Blocks the stop signals (before any thread starts), parses the command
// line (himoe::ParseCommandLine), starts glog (to stderr unless
// GLOG_logtostderr or GLOG_log_dir is set) and the crash handler. First thing
// in main().
void InitService(int argc, char** argv, const ServiceInfo& info);

// The serving set-up of compute (ConfigureServingCompute) with --threads and
// --blas_probe.
absl::Status ConfigureServiceCompute();

// A /metrics endpoint on --metrics_address:`port` (0 picks one; errors name
// --metrics_port); null when `port` is negative.
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartServiceMetrics(int port);

// With --port_file: writes "<port>[ <metrics port>]" there (atomically), the
// metrics port when `metrics` is not null.
absl::Status WritePortFile(int port, prometheus::Exposer* metrics);

// --max_message_bytes.
int MaxMessageBytesFlag();

// Waits for SIGINT, SIGTERM or SIGHUP; returns it.
int WaitUntilStopSignal();

// main()'s exit status for `status`: 0, or 1 with "<name>: <status>" logged.
int ServiceExitCode(const ServiceInfo& info, const absl::Status& status);

namespace service_internal {
// The help --help prints for a shared flag: the binary's wording (`field` of
// InitService's ServiceFlagHelp), else `shared`.
std::string FlagHelp(std::string ServiceFlagHelp::*field, const char* shared);
}  // namespace service_internal

}  // namespace himoe

#endif  // HIMOE_COMMON_SERVICE_MAIN_H_
