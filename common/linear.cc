#include "common/linear.h"

#include <atomic>
#include <cstring>
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

// Lanes 0-7: a's lanes l + l+8; lanes 8-15: b's (Sum's first level, for two).
__attribute__((always_inline)) inline V16 HalfSums(const V16& a, const V16& b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                 31);
}

// Four accumulators' lane sums, each in Sum's tree (lane l + lane l+8, then
// + 4, then (0 + 2) + (1 + 3)): the same bits as four Sum calls, with the
// shuffles shared.
__attribute__((always_inline)) inline V4 Sum4(const V16& a, const V16& b, const V16& c,
                                              const V16& d) {
  const V16 ab = HalfSums(a, b), cd = HalfSums(c, d);
  const V16 q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                                        26, 27) +
                __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                                        30, 31);
  const V8 t = __builtin_shufflevector(q, q, 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(q, q, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(t, t, 0, 2, 4, 6) + __builtin_shufflevector(t, t, 1, 3, 5, 7);
}

// out[r, n] = bias[n] + x[r, :] . w[n, :] for R rows and N = 1 or 4
// outputs: one accumulator per output over k in steps of 16, then Sum's tree.
// An output's arithmetic is the same in every block shape, so a row's result
// does not depend on the rows computed beside it. `ahead` (or null): N weight
// rows a block or two on, prefetched as these are read, so that a cold weight
// streams at about its 1-row speed whatever R.
template <int R, int N>
__attribute__((always_inline)) inline void Block(const float* x, int64_t k, const float* w,
                                                 const float* ahead, const float* bias, float* out,
                                                 int64_t n_out) {
  static_assert(N == 1 || N == 4);
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
    if constexpr (N == 1) {
      out[r * n_out] = Sum(acc[r][0]) + (bias == nullptr ? 0.f : bias[0]);
    } else {
      const V4 sums = Sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]) +
                      (bias == nullptr ? V4{} : V4{bias[0], bias[1], bias[2], bias[3]});
      std::memcpy(out + r * n_out, &sums, sizeof(sums));
    }
  }
}

// Outputs n .. n + N of every row: rows 4, then 2, then 1 at a time, the
// first block prefetching, the later ones reading the weight rows it left in
// the cache.
template <int N>
__attribute__((always_inline)) inline void OutputBlock(const float* x, int64_t rows, int64_t k,
                                                       const float* w, const float* ahead,
                                                       const float* bias, float* out,
                                                       int64_t n_out) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4, ahead = nullptr) {
    Block<4, N>(x + r * k, k, w, ahead, bias, out + r * n_out, n_out);
  }
  for (; r + 2 <= rows; r += 2, ahead = nullptr) {
    Block<2, N>(x + r * k, k, w, ahead, bias, out + r * n_out, n_out);
  }
  for (; r < rows; ++r, ahead = nullptr) {
    Block<1, N>(x + r * k, k, w, ahead, bias, out + r * n_out, n_out);
  }
}

// x [rows, k] . w[n_out, k]^T + bias -> out [rows, n_out], all row-major;
// k % 16 == 0. Four weight rows at a time against every row of x, so the
// weight is read from memory once, where a GEMV per row reads it per row
// and a BLIS GEMM without small-matrix kernels packs it whole.
HIMOE_CPU_CLONES
void SmallRowsProduct(const float* x, int64_t rows, const float* w, const float* bias,
                      int64_t n_out, int64_t k, float* out) {
  int64_t n = 0;
  for (; n + 4 <= n_out; n += 4) {
    const float* ahead = n + 12 <= n_out ? w + (n + 8) * k : nullptr;  // two blocks on
    OutputBlock<4>(x, rows, k, w + n * k, ahead, bias == nullptr ? nullptr : bias + n, out + n,
                   n_out);
  }
  for (; n < n_out; ++n) {
    const float* ahead = n + 2 <= n_out ? w + (n + 1) * k : nullptr;
    OutputBlock<1>(x, rows, k, w + n * k, ahead, bias == nullptr ? nullptr : bias + n, out + n,
                   n_out);
  }
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
