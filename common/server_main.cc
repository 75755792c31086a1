// The flags of the binaries that serve gRPC (himoe-expert, himoe-router).
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/metrics_endpoint.h"
#include "common/service_main.h"

using himoe::ServiceFlagHelp;
using himoe::service_internal::FlagHelp;

ABSL_FLAG(std::string, port_file, "",
          FlagHelp(&ServiceFlagHelp::port_file,
                   "if set, write \"<grpc port>[ <metrics port>]\" here once serving"));
ABSL_FLAG(int, max_message_bytes, 64 << 20,
          FlagHelp(&ServiceFlagHelp::max_message_bytes, "max gRPC message, both ways"));

namespace himoe {

absl::Status WritePortFile(int port, prometheus::Exposer* metrics) {
  const std::string path = absl::GetFlag(FLAGS_port_file);
  if (path.empty()) return absl::OkStatus();
  std::string ports = absl::StrCat(port);
  if (metrics != nullptr) absl::StrAppend(&ports, " ", MetricsPort(*metrics));
  return WriteFileAtomically(path, ports + "\n");
}

int MaxMessageBytesFlag() { return absl::GetFlag(FLAGS_max_message_bytes); }

}  // namespace himoe
