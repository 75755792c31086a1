// Free loopback ports for services that must be given a fixed port.
// A port the kernel hands out for port 0 lies in the ephemeral range
// (net.ipv4.ip_local_port_range), where any outgoing connection may take it as
// its source port between the pick and the service's bind. These are drawn at
// random below that range instead, where the kernel assigns nothing
// (scripts/loopback_ports.py does the same for the Python tests).
#ifndef HIMOE_TESTS_LOOPBACK_PORTS_H_
#define HIMOE_TESTS_LOOPBACK_PORTS_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <random>
#include <vector>

namespace himoe::test_util {

inline int EphemeralPortLow() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0;
  return (in >> low) ? low : 32768;
}

// n distinct ports that were free on 127.0.0.1, all bound at once, then
// released; fewer if not enough were found.
inline std::vector<int> FreeLoopbackPorts(int n) {
  constexpr int kLowest = 10000;
  const int high = EphemeralPortLow();
  std::random_device seed;
  std::mt19937 rng(seed());
  std::uniform_int_distribution<int> pick(kLowest, high > kLowest + 1000 ? high - 1 : kLowest);
  std::vector<int> fds, ports;
  for (int tries = 0; tries < 20 * n + 100 && static_cast<int>(ports.size()) < n; ++tries) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) break;
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(high > kLowest + 1000 ? pick(rng) : 0);
    socklen_t len = sizeof(addr);
    if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      close(fd);
      continue;
    }
    fds.push_back(fd);
    ports.push_back(ntohs(addr.sin_port));
  }
  for (int fd : fds) close(fd);
  return ports;
}

}  // namespace himoe::test_util

#endif  // HIMOE_TESTS_LOOPBACK_PORTS_H_
