#ifndef HIMOE_COMMON_METRICS_ENDPOINT_H_
#define HIMOE_COMMON_METRICS_ENDPOINT_H_

#include <memory>
#include <string>

#include <prometheus/exposer.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace himoe {

// A Prometheus /metrics endpoint on host:port (port 0 picks one). An error
// (Unavailable) names `flag`, the flag that chose the port.
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartMetricsEndpoint(
    absl::string_view flag, absl::string_view host, int port);

// The port an endpoint listens on.
int MetricsPort(prometheus::Exposer& exposer);

}  // namespace himoe

#endif  // HIMOE_COMMON_METRICS_ENDPOINT_H_
