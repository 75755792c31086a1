#include "tests/common/big_tls.h"

// Initial-exec TLS in a library loaded at start-up lands in glibc's static
// TLS block, which every thread's stack holds: as CUDA's libraries do, larger
// than civetweb's 100 KiB thread stacks.
__attribute__((tls_model("initial-exec"))) thread_local char big_tls[kBigTlsBytes];

char* BigTls() { return big_tls; }
