#include "common/gelu.h"

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/parallel_for.h"
#include "common/vector_lanes.h"

namespace himoe {
namespace {

using lanes::ExpNonPositive;
using lanes::I16;
using lanes::kLanes;
using lanes::Load;
using lanes::Splat;
using lanes::Store;
using lanes::V16;

constexpr float kSqrtHalf = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

// Phi(x) and exp(-x^2 / 2): erf(z), z = x / sqrt(2), as 1 - t P(t) exp(-z^2)
// with t = 1 / (1 + p |z|) (Abramowitz and Stegun 7.1.26), odd in z.
__attribute__((always_inline)) inline void NormalCdf(V16 x, V16& cdf, V16& gauss) {
  const V16 z = x * kSqrtHalf;
  const V16 az = z < 0.0f ? -z : z;
  const V16 t = 1.0f / (1.0f + 0.3275911f * az);
  const V16 poly =
      ((((1.061405429f * t - 1.453152027f) * t + 1.421413741f) * t - 0.284496736f) * t +
       0.254829592f) *
      t;
  gauss = ExpNonPositive(-z * z);
  const V16 erf_abs = 1.0f - poly * gauss;
  cdf = 0.5f + 0.5f * (z < 0.0f ? -erf_abs : erf_abs);
}

// n values, a multiple of 16.
HIMOE_CPU_CLONES
void GeluLanes(const float* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const V16 x = Load(in + i);
    V16 cdf, gauss;
    NormalCdf(x, cdf, gauss);
    Store(out + i, x * cdf);
  }
}

HIMOE_CPU_CLONES
void GeluBackwardLanes(const float* grad, const float* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const V16 x = Load(in + i);
    V16 cdf, gauss;
    NormalCdf(x, cdf, gauss);
    Store(out + i, Load(grad + i) * (cdf + x * (gauss * kInvSqrt2Pi)));
  }
}

bool OwnLoopApplies(const at::Tensor& t) {
  return t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

// Runs lanes(offset, count) over [0, n) in blocks of whole 16-value lanes
// split across LibTorch's threads (inline inside a parallel region), then the
// last partial lane through a padded copy, so every value goes through the
// same arithmetic. `inputs` are the pointers lanes reads, `out` what it writes.
template <int kInputs, typename Lanes>
void ForLanes(int64_t n, const float* const (&inputs)[kInputs], float* out, const Lanes& lanes) {
  constexpr int64_t kGrainLanes = 2048;  // 32 K values per task
  const int64_t whole = n / kLanes;
  ParallelForRange(0, whole, kGrainLanes, at::get_num_threads(), [&](int64_t begin, int64_t end) {
    const float* in[kInputs];
    for (int k = 0; k < kInputs; ++k) in[k] = inputs[k] + begin * kLanes;
    lanes(in, out + begin * kLanes, (end - begin) * kLanes);
  });
  const int64_t done = whole * kLanes, rest = n - done;
  if (rest == 0) return;
  float padded_in[kInputs][kLanes] = {};
  float padded_out[kLanes];
  const float* in[kInputs];
  for (int k = 0; k < kInputs; ++k) {
    std::copy(inputs[k] + done, inputs[k] + n, padded_in[k]);
    in[k] = padded_in[k];
  }
  lanes(in, padded_out, kLanes);
  std::copy(padded_out, padded_out + rest, out + done);
}

// oneDNN (LibTorch's CPU GELU) JIT-compiles a kernel per shape and caches
// 1024; row counts that change every step compiled on most calls. Fixed
// tiles of rows reuse at most kTileRows kernels per width; elementwise, so
// the values are the same.
constexpr int64_t kTileRows = 128;

template <typename Op>
void ForRowTiles(const at::Tensor& like, const Op& op) {
  const int64_t rows = like.dim() == 0 ? 1 : like.size(0);
  if (like.dim() == 0 || !like.is_cpu()) return op(0, rows, /*whole=*/true);
  for (int64_t b = 0; b < rows; b += kTileRows) {
    op(b, std::min(kTileRows, rows - b), /*whole=*/false);
  }
}

}  // namespace

void GeluOut(at::Tensor& out, const at::Tensor& in) {
  if (OwnLoopApplies(in) && OwnLoopApplies(out) && out.sizes() == in.sizes()) {
    ForLanes<1>(in.numel(), {in.data_ptr<float>()}, out.data_ptr<float>(),
                [](const float* const (&x)[1], float* y, int64_t n) { GeluLanes(x[0], y, n); });
    return;
  }
  ForRowTiles(in, [&](int64_t b, int64_t n, bool whole) {
    at::Tensor o = whole ? out : out.narrow(0, b, n);
    at::gelu_out(o, whole ? in : in.narrow(0, b, n));
  });
}

void GeluBackwardOut(at::Tensor& out, const at::Tensor& grad, const at::Tensor& in) {
  if (OwnLoopApplies(in) && OwnLoopApplies(grad) && OwnLoopApplies(out) &&
      grad.sizes() == in.sizes() && out.sizes() == in.sizes()) {
    ForLanes<2>(in.numel(), {grad.data_ptr<float>(), in.data_ptr<float>()},
                out.data_ptr<float>(), [](const float* const (&x)[2], float* y, int64_t n) {
                  GeluBackwardLanes(x[0], x[1], y, n);
                });
    return;
  }
  ForRowTiles(in, [&](int64_t b, int64_t n, bool whole) {
    at::Tensor o = whole ? out : out.narrow(0, b, n);
    at::gelu_backward_out(o, whole ? grad : grad.narrow(0, b, n), whole ? in : in.narrow(0, b, n));
  });
}

}  // namespace himoe
