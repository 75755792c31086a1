#include "common/host_port.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace himoe {

absl::StatusOr<HostPort> ParseHostPort(absl::string_view field, absl::string_view address) {
  HostPort hp;
  absl::string_view port_text;
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    if (close == absl::string_view::npos || close + 1 >= address.size() ||
        address[close + 1] != ':') {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": '", address, "' is not [host]:port"));
    }
    hp.host = std::string(address.substr(1, close - 1));
    port_text = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": '", address, "' is not host:port"));
    }
    hp.host = std::string(address.substr(0, colon));
    port_text = address.substr(colon + 1);
    if (hp.host.find(':') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": '", address, "' is ambiguous; write an IPv6 host as [host]:port"));
    }
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

std::string JoinHostPort(absl::string_view host, int port) {
  return host.find(':') != absl::string_view::npos ? absl::StrCat("[", host, "]:", port)
                                                   : absl::StrCat(host, ":", port);
}

bool IsLocalHost(absl::string_view host) {
  if (host == "localhost") return true;
  const std::string h(host);
  in_addr v4;
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) {
    const uint32_t a = ntohl(v4.s_addr);
    return (a >> 24) == 127 || a == 0;
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, h.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_LOOPBACK(&v6) || IN6_IS_ADDR_UNSPECIFIED(&v6);
  }
  return false;
}

bool IsLoopbackHost(absl::string_view host) {
  if (host == "localhost") return true;
  const std::string h(host);
  in_addr v4;
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  return inet_pton(AF_INET6, h.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

std::string DialHost(absl::string_view host) {
  if (host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return std::string(host);
}

}  // namespace himoe
