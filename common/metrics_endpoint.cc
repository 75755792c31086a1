#include "common/metrics_endpoint.h"

#include <exception>

#include "absl/strings/str_cat.h"
#include "common/host_port.h"

namespace himoe {

absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartMetricsEndpoint(
    absl::string_view flag, absl::string_view host, int port) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", port, " is not a port (0-65535; 0 picks one)"));
  }
  try {
    return std::make_unique<prometheus::Exposer>(JoinHostPort(host, port));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(flag, " ", port, ": cannot listen on ",
                                               JoinHostPort(host, port), ": ", e.what()));
  }
}

int MetricsPort(prometheus::Exposer& exposer) {
  const auto ports = exposer.GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

}  // namespace himoe
