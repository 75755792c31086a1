#include "common/linear.h"

#include <atomic>
#include <vector>

#include <ATen/ATen.h>

#include "common/vector_lanes.h"

namespace himoe {
namespace {

std::atomic<int64_t> rowwise_rows{0};

using lanes::Load;
using lanes::V16;
using lanes::V4;
using lanes::V8;

// The 16 lanes summed in one fixed tree.
__attribute__((always_inline)) inline float Sum(const V16& s) {
  const V8 h = __builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13, 14, 15);
  const V4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// out[r, n] = bias[n] + x[r, :] . w[n, :] for R rows and N outputs: one
// accumulator per output over k in steps of 16, then Sum. An output's
// arithmetic is the same in every block shape, so a row's result does not
// depend on the rows computed beside it. `ahead` (or null): N weight rows
// a block or two on, prefetched as these are read, so that a cold weight
// streams at about its 1-row speed whatever R.
template <int R, int N>
__attribute__((always_inline)) inline void Block(const float* x, int64_t k, const float* w,
                                                 const float* ahead, const float* bias, float* out,
                                                 int64_t n_out) {
  V16 acc[R][N] = {};
  for (int64_t i = 0; i < k; i += 16) {
    V16 wv[N];
    for (int n = 0; n < N; ++n) {
      if (ahead != nullptr) __builtin_prefetch(ahead + n * k + i);
      wv[n] = Load(w + n * k + i);
    }
    for (int r = 0; r < R; ++r) {
      const V16 xv = Load(x + r * k + i);
      for (int n = 0; n < N; ++n) acc[r][n] += xv * wv[n];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < N; ++n) {
      out[r * n_out + n] = Sum(acc[r][n]) + (bias == nullptr ? 0.f : bias[n]);
    }
  }
}

template <int R>
__attribute__((always_inline)) inline void RowBlock(const float* x, int64_t k, const float* w,
                                                    const float* bias, float* out, int64_t n_out) {
  int64_t n = 0;
  for (; n + 2 <= n_out; n += 2) {
    const float* ahead = n + 6 <= n_out ? w + (n + 4) * k : nullptr;  // two blocks on
    Block<R, 2>(x, k, w + n * k, ahead, bias == nullptr ? nullptr : bias + n, out + n, n_out);
  }
  for (; n < n_out; ++n) {
    const float* ahead = n + 2 <= n_out ? w + (n + 1) * k : nullptr;
    Block<R, 1>(x, k, w + n * k, ahead, bias == nullptr ? nullptr : bias + n, out + n, n_out);
  }
}

// x [rows, k] . w[n_out, k]^T + bias -> out [rows, n_out], all row-major;
// k % 16 == 0. The weight is read once per 4 rows, where a GEMV per row reads
// it per row and a BLIS GEMM without small-matrix kernels packs it whole.
HIMOE_CPU_CLONES
void SmallRowsProduct(const float* x, int64_t rows, const float* w, const float* bias,
                      int64_t n_out, int64_t k, float* out) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) RowBlock<4>(x + r * k, k, w, bias, out + r * n_out, n_out);
  for (; r + 2 <= rows; r += 2) RowBlock<2>(x + r * k, k, w, bias, out + r * n_out, n_out);
  for (; r < rows; ++r) RowBlock<1>(x + r * k, k, w, bias, out + r * n_out, n_out);
}

bool NeedsGrad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }

}  // namespace

int64_t RowwiseLinearRows() { return rowwise_rows.load(std::memory_order_relaxed); }
void SetRowwiseLinearRows(int64_t rows) { rowwise_rows.store(rows, std::memory_order_relaxed); }

bool SmallRowsLinearApplies(const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias) {
  const auto is_float_cpu = [](const at::Tensor& t) {
    return t.is_cpu() && t.scalar_type() == at::kFloat;
  };
  if (x.dim() != 2 || weight.dim() != 2 || !is_float_cpu(x) || !is_float_cpu(weight) ||
      !weight.is_contiguous() || weight.size(1) != x.size(1) || x.size(1) % 16 != 0) {
    return false;
  }
  if (bias.defined() &&
      (!is_float_cpu(bias) || bias.dim() != 1 || bias.size(0) != weight.size(0) ||
       !bias.is_contiguous())) {
    return false;
  }
  return !(at::GradMode::is_enabled() && (NeedsGrad(x) || NeedsGrad(weight) || NeedsGrad(bias)));
}

at::Tensor SmallRowsLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty({in.size(0), weight.size(0)}, in.options());
  SmallRowsProduct(in.data_ptr<float>(), in.size(0), weight.data_ptr<float>(),
                   bias.defined() ? bias.data_ptr<float>() : nullptr, weight.size(0), in.size(1),
                   out.data_ptr<float>());
  return out;
}

at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t rows = x.dim() == 2 ? x.size(0) : 0;
  if (rows < 1 || rows >= RowwiseLinearRows() || !x.is_cpu()) {
    return at::linear(x, weight, bias);
  }
  if (SmallRowsLinearApplies(x, weight, bias)) return SmallRowsLinear(x, weight, bias);
  std::vector<at::Tensor> out;
  out.reserve(rows);
  for (int64_t i = 0; i < rows; ++i) {
    out.push_back(bias.defined() ? at::addmv(bias, weight, x[i]) : at::mv(weight, x[i]));
  }
  return at::stack(out);
}

}  // namespace himoe
