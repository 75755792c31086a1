#ifndef HIMOE_COMMON_HOST_PORT_H_
#define HIMOE_COMMON_HOST_PORT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace himoe {

struct HostPort {
  std::string host;  // without IPv6 brackets
  int port = 0;      // 0..65535; 0 = pick one when listening
};

// Parses "host:port" or "[v6 host]:port". InvalidArgument names `field`
// ("--address", "groups[2].address") and says what was expected.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view field, absl::string_view address);

// "host:port", with brackets around an IPv6 host.
std::string JoinHostPort(absl::string_view host, int port);

// Loopback or "all local interfaces" (127.0.0.0/8, ::1, 0.0.0.0, ::, localhost).
bool IsLocalHost(absl::string_view host);
// Loopback only (127.0.0.0/8, ::1, localhost): no other host can connect.
bool IsLoopbackHost(absl::string_view host);

// Where this machine reaches a service listening on `host` (0.0.0.0 -> 127.0.0.1,
// :: -> ::1, anything else unchanged).
std::string DialHost(absl::string_view host);

}  // namespace himoe

#endif  // HIMOE_COMMON_HOST_PORT_H_
