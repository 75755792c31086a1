#ifndef HIMOE_TESTS_COMMON_BIG_TLS_H_
#define HIMOE_TESTS_COMMON_BIG_TLS_H_

#include <cstddef>

inline constexpr size_t kBigTlsBytes = 256 * 1024;

// This thread's kBigTlsBytes of the library's thread-local buffer.
char* BigTls();

#endif  // HIMOE_TESTS_COMMON_BIG_TLS_H_
