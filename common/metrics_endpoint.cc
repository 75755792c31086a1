#include "common/metrics_endpoint.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>

#include <exception>

#include "absl/strings/str_cat.h"
#include "common/host_port.h"
#include "common/thread_stack.h"

// civetweb, prometheus-cpp's HTTP server, creates its threads with the stack
// size it was compiled with (Debian's: 100 KiB). glibc takes the static TLS of
// every library loaded at start-up out of each thread's stack and refuses a
// stack it does not fit (EINVAL): beside a CUDA LibTorch that TLS is larger
// than 100 KiB, and the endpoint failed to start ("null context when
// constructing CivetServer", civetweb: "Cannot create first worker thread").
// This definition, in every binary that serves /metrics, interposes libc's for
// the whole process (the link exports it): a thread keeps the stack it asked
// for, TLS added.
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  using Fn = int (*)(pthread_attr_t*, size_t);
  static const Fn libc = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  if (libc == nullptr) return ENOSYS;
  return libc(attr, himoe::StackSizeKeeping(size));
}

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
