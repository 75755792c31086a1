#include "common/all_finite.h"

#include <cstdint>

#include <ATen/ATen.h>

namespace himoe {
namespace {

// True when no element of `n` words has all of `exponent`'s bits set (the
// IEEE encoding of NaN and Inf). Branch-free inner loop, so it vectorises.
template <typename Word>
bool NoneAllOnes(const void* data, int64_t n, Word exponent) {
  const auto* w = static_cast<const Word*>(data);
  constexpr int64_t kBlock = 256;
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    const int64_t end = begin + kBlock < n ? begin + kBlock : n;
    bool bad = false;
    for (int64_t i = begin; i < end; ++i) bad |= (w[i] & exponent) == exponent;
    if (bad) return false;
  }
  return true;
}

}  // namespace

bool AllFinite(const at::Tensor& t) {
  if (t.numel() == 0 || !at::isFloatingType(t.scalar_type())) return true;
  if (!t.device().is_cpu()) return at::isfinite(t.detach()).all().item<bool>();
  const at::Tensor c = t.detach().contiguous();
  const void* data = c.data_ptr();
  const int64_t n = c.numel();
  switch (c.scalar_type()) {
    case at::kFloat:
      return NoneAllOnes<uint32_t>(data, n, 0x7F800000u);
    case at::kDouble:
      return NoneAllOnes<uint64_t>(data, n, 0x7FF0000000000000ull);
    case at::kBFloat16:
      return NoneAllOnes<uint16_t>(data, n, 0x7F80u);
    case at::kHalf:
      return NoneAllOnes<uint16_t>(data, n, 0x7C00u);
    default:
      return at::isfinite(c).all().item<bool>();
  }
}

}  // namespace himoe
