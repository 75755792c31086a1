#ifndef HIMOE_COMMON_VECTOR_LANES_H_
#define HIMOE_COMMON_VECTOR_LANES_H_

// The project's own CPU loops (common/linear.cc, common/gelu.cc, the MoE
// layer's dispatch and combine, attention): GCC's
// vector extensions, one AVX-512 register, two AVX2 ones or four SSE ones,
// whichever clone HIMOE_CPU_CLONES compiled. Only for .cc files: the
// always-inline helpers never cross a call (GCC's -Wpsabi, which warns of
// their AVX-512 argument ABI, is off where this is included).

#include <cstdint>
#include <cstring>

#pragma GCC diagnostic ignored "-Wpsabi"

// A function compiled for x86-64-v4 (AVX-512), v3 (AVX2) and the baseline,
// picked at load time; plain code elsewhere (and under clang). Under
// ThreadSanitizer one plain version, not instrumented: TSan instruments the
// clones' load-time resolver, which runs before its runtime is up (a crash
// at load), and these loops only read and write buffers their caller owns
// (instrumented, the router tests ran past their deadlines).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__)
#define HIMOE_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__SANITIZE_THREAD__)
#define HIMOE_CPU_CLONES __attribute__((no_sanitize_thread))
#else
#define HIMOE_CPU_CLONES
#endif

namespace himoe::lanes {

inline constexpr int64_t kLanes = 16;  // floats in a V16

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

// The lanes added in lane order (a fixed order: the same bits on any thread).
__attribute__((always_inline)) inline float Sum(const V16& v) {
  float sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += v[l];
  return sum;
}

__attribute__((always_inline)) inline V16 Splat(float v) { return V16{} + v; }

// exp(x) for x <= 0: Cephes's expf (x = n ln 2 + r, a degree-6 polynomial in
// r, times 2^n); 0 below -87, where 2^n leaves the normal floats.
__attribute__((always_inline)) inline V16 ExpNonPositive(V16 x) {
  const I16 underflow = x < -87.0f;
  const V16 fx = x * 1.44269504088896341f + 0.5f;
  V16 fn = __builtin_convertvector(__builtin_convertvector(fx, I16), V16);
  fn = fn > fx ? fn - 1.0f : fn;  // floor (the conversion truncates)
  const V16 r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  V16 p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const I16 bits = (__builtin_convertvector(fn, I16) + 127) << 23;
  V16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? Splat(0.0f) : p * scale;
}

}  // namespace himoe::lanes

#endif  // HIMOE_COMMON_VECTOR_LANES_H_
