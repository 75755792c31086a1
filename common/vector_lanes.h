#ifndef HIMOE_COMMON_VECTOR_LANES_H_
#define HIMOE_COMMON_VECTOR_LANES_H_

// The project's own CPU loops (common/linear.cc, common/gelu.cc): GCC's
// vector extensions, one AVX-512 register, two AVX2 ones or four SSE ones,
// whichever clone HIMOE_CPU_CLONES compiled. Only for .cc files: the
// always-inline helpers never cross a call (GCC's -Wpsabi, which warns of
// their AVX-512 argument ABI, is off where this is included).

#include <cstring>

#pragma GCC diagnostic ignored "-Wpsabi"

// A function compiled for x86-64-v4 (AVX-512), v3 (AVX2) and the baseline,
// picked at load time; plain code elsewhere (and under clang).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HIMOE_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HIMOE_CPU_CLONES
#endif

namespace himoe::lanes {

using V16 = float __attribute__((vector_size(64)));
using V8 = float __attribute__((vector_size(32)));
using V4 = float __attribute__((vector_size(16)));
using I16 = int __attribute__((vector_size(64)));

__attribute__((always_inline)) inline V16 Load(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

__attribute__((always_inline)) inline void Store(float* p, const V16& v) {
  std::memcpy(p, &v, sizeof(v));
}

}  // namespace himoe::lanes

#endif  // HIMOE_COMMON_VECTOR_LANES_H_
