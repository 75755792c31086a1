#include "model/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/csrc/autograd/custom_function.h>

#include "common/parallel_for.h"
#include "common/vector_lanes.h"

namespace himoe::model {
namespace {

using lanes::ExpNonPositive;
using lanes::kLanes;
using lanes::Load;
using lanes::Store;
using lanes::V16;
constexpr int64_t kScoreBlock = 2 * kLanes;

int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// One head's rows: row t of q (k, v, ...) at base + t * stride, d_h values.
struct Rows {
  const float* base;
  int64_t stride;
  const float* at(int64_t t) const { return base + t * stride; }
};

// out[0 .. RoundUp(n, 32)) = scale * (x . row j) for the rows of `rows_t`,
// the head's rows transposed, [d_h, tp] and zero past the last row. Four
// partial sums per output (d mod 4): independent FMA chains, where one
// chain waits on each FMA's latency.
__attribute__((always_inline)) inline void DotsWithRows(const float* x, const float* rows_t,
                                                        int64_t d_h, int64_t tp, int64_t n,
                                                        float scale, float* out) {
  for (int64_t c = 0; c < n; c += kScoreBlock) {
    V16 a0{}, a1{}, a2{}, a3{}, a4{}, a5{}, a6{}, a7{};
    for (int64_t d = 0; d < d_h; d += 4) {
      const float* r = rows_t + d * tp + c;
      a0 += x[d] * Load(r);
      a1 += x[d] * Load(r + kLanes);
      a2 += x[d + 1] * Load(r + tp);
      a3 += x[d + 1] * Load(r + tp + kLanes);
      a4 += x[d + 2] * Load(r + 2 * tp);
      a5 += x[d + 2] * Load(r + 2 * tp + kLanes);
      a6 += x[d + 3] * Load(r + 3 * tp);
      a7 += x[d + 3] * Load(r + 3 * tp + kLanes);
    }
    Store(out + c, ((a0 + a2) + (a4 + a6)) * scale);
    Store(out + c + kLanes, ((a1 + a3) + (a5 + a7)) * scale);
  }
}

// out = sum over j < n of coef[j * coef_stride] * row j, d_h values (a
// multiple of 16); four partial sums (j mod 4, the last n mod 4 rows into
// the first), added in a fixed order.
__attribute__((always_inline)) inline void WeightedSumOfRows(const float* coef,
                                                             int64_t coef_stride, int64_t n,
                                                             Rows rows, int64_t d_h, float* out) {
  const int64_t whole = n / 4 * 4;
  int64_t d = 0;
  for (; d + 2 * kLanes <= d_h; d += 2 * kLanes) {
    V16 a0{}, a1{}, a2{}, a3{}, a4{}, a5{}, a6{}, a7{};
    for (int64_t j = 0; j < whole; j += 4) {
      const float* r = rows.at(j) + d;
      const float w0 = coef[j * coef_stride], w1 = coef[(j + 1) * coef_stride],
                  w2 = coef[(j + 2) * coef_stride], w3 = coef[(j + 3) * coef_stride];
      a0 += w0 * Load(r);
      a1 += w0 * Load(r + kLanes);
      a2 += w1 * Load(r + rows.stride);
      a3 += w1 * Load(r + rows.stride + kLanes);
      a4 += w2 * Load(r + 2 * rows.stride);
      a5 += w2 * Load(r + 2 * rows.stride + kLanes);
      a6 += w3 * Load(r + 3 * rows.stride);
      a7 += w3 * Load(r + 3 * rows.stride + kLanes);
    }
    for (int64_t j = whole; j < n; ++j) {
      const float w = coef[j * coef_stride];
      a0 += w * Load(rows.at(j) + d);
      a1 += w * Load(rows.at(j) + d + kLanes);
    }
    Store(out + d, (a0 + a2) + (a4 + a6));
    Store(out + d + kLanes, (a1 + a3) + (a5 + a7));
  }
  for (; d < d_h; d += kLanes) {
    V16 a0{}, a1{}, a2{}, a3{};
    for (int64_t j = 0; j < whole; j += 4) {
      const float* r = rows.at(j) + d;
      a0 += coef[j * coef_stride] * Load(r);
      a1 += coef[(j + 1) * coef_stride] * Load(r + rows.stride);
      a2 += coef[(j + 2) * coef_stride] * Load(r + 2 * rows.stride);
      a3 += coef[(j + 3) * coef_stride] * Load(r + 3 * rows.stride);
    }
    for (int64_t j = whole; j < n; ++j) a0 += coef[j * coef_stride] * Load(rows.at(j) + d);
    Store(out + d, (a0 + a1) + (a2 + a3));
  }
}

// A row's softmax over s[0 .. n), in place; s[n .. RoundUp(n, 16)) become 0.
__attribute__((always_inline)) inline void SoftmaxRow(float* s, int64_t n) {
  const int64_t nv = RoundUp(n, kLanes);
  for (int64_t j = n; j < nv; ++j) s[j] = -std::numeric_limits<float>::infinity();
  V16 m = Load(s);
  for (int64_t c = kLanes; c < nv; c += kLanes) {
    const V16 v = Load(s + c);
    m = v > m ? v : m;
  }
  float max = m[0];
  for (int l = 1; l < kLanes; ++l) max = std::max(max, m[l]);
  V16 sum{};
  for (int64_t c = 0; c < nv; c += kLanes) {
    const V16 e = ExpNonPositive(Load(s + c) - max);
    Store(s + c, e);
    sum += e;
  }
  const float inv = 1.0f / lanes::Sum(sum);
  for (int64_t c = 0; c < nv; c += kLanes) Store(s + c, Load(s + c) * inv);
}

// `rows` transposed into out [d_h, tp], zero past row t.
void Transpose(Rows rows, int64_t t, int64_t d_h, int64_t tp, float* out) {
  for (int64_t d = 0; d < d_h; ++d) {
    for (int64_t j = 0; j < t; ++j) out[d * tp + j] = rows.at(j)[d];
    for (int64_t j = t; j < tp; ++j) out[d * tp + j] = 0;
  }
}

struct HeadShape {
  int64_t t;      // positions
  int64_t d_h;    // head width, a multiple of 16
  int64_t tp;     // t rounded up to 32
  float scale;    // 1 / sqrt(d_h)
};

// One head forward: p [t, t] (row i: columns 0 .. i written), y rows.
// Scratch: kt [d_h * tp], s [tp].
HIMOE_CPU_CLONES
void HeadForward(const HeadShape& h, Rows q, Rows k, Rows v, float* p, float* y,
                 int64_t y_stride, float* kt, float* s) {
  Transpose(k, h.t, h.d_h, h.tp, kt);
  for (int64_t i = 0; i < h.t; ++i) {
    DotsWithRows(q.at(i), kt, h.d_h, h.tp, i + 1, h.scale, s);
    SoftmaxRow(s, i + 1);
    std::memcpy(p + i * h.t, s, (i + 1) * sizeof(float));
    WeightedSumOfRows(s, 1, i + 1, v, h.d_h, y + i * y_stride);
  }
}

// One query against n cached rows of one head: y = softmax(scale q kᵀ) v.
// Scratch: s [RoundUp(n, 16)].
HIMOE_CPU_CLONES
void DecodeHead(const float* q, Rows k, Rows v, int64_t n, int64_t d_h, float scale, float* s,
                float* y) {
  for (int64_t j = 0; j < n; ++j) {
    const float* r = k.at(j);
    V16 a = Load(q) * Load(r);
    for (int64_t d = kLanes; d < d_h; d += kLanes) a += Load(q + d) * Load(r + d);
    s[j] = lanes::Sum(a) * scale;
  }
  SoftmaxRow(s, n);
  WeightedSumOfRows(s, 1, n, v, d_h, y);
}

// One head backward from gy: dq, dk, dv rows (stride `g_stride`).
// Scratch: vt [d_h * tp], dp [tp], row [tp], ds [t * tp].
HIMOE_CPU_CLONES
void HeadBackward(const HeadShape& h, Rows q, Rows k, Rows v, const float* p, Rows gy,
                  float* dq, float* dk, float* dv, int64_t g_stride, float* vt, float* dp,
                  float* row, float* ds) {
  Transpose(v, h.t, h.d_h, h.tp, vt);
  for (int64_t i = 0; i < h.t; ++i) {
    const int64_t n = i + 1, nv = RoundUp(n, kLanes);
    DotsWithRows(gy.at(i), vt, h.d_h, h.tp, n, 1.0f, dp);  // dP[i, j] = gy_i . v_j
    std::memcpy(row, p + i * h.t, n * sizeof(float));
    for (int64_t j = n; j < nv; ++j) row[j] = 0;
    // Softmax backward: dS = P (dP - sum_j P dP), then the 1/sqrt(d_h).
    V16 acc{};
    for (int64_t c = 0; c < nv; c += kLanes) acc += Load(row + c) * Load(dp + c);
    const float dot = lanes::Sum(acc);
    float* ds_i = ds + i * h.tp;
    for (int64_t c = 0; c < nv; c += kLanes) {
      Store(ds_i + c, Load(row + c) * (Load(dp + c) - dot) * h.scale);
    }
    WeightedSumOfRows(ds_i, 1, n, k, h.d_h, dq + i * g_stride);  // dQ = dS K
  }
  for (int64_t j = 0; j < h.t; ++j) {
    const int64_t n = h.t - j;  // the queries i >= j that see key j
    WeightedSumOfRows(ds + j * h.tp + j, h.tp, n, Rows{q.at(j), q.stride}, h.d_h,
                      dk + j * g_stride);  // dK = dS^T Q
    WeightedSumOfRows(p + j * h.t + j, h.t, n, Rows{gy.at(j), gy.stride}, h.d_h,
                      dv + j * g_stride);  // dV = P^T dY
  }
}

// Heads packed as a block's qkv projection writes them: qkv [B, T, 3C], y
// [B, T, C], head h at columns h * d_h of q, k, v and y. Each head on one
// thread, its probabilities kept for backward.
class PackedCausalAttention : public torch::autograd::Function<PackedCausalAttention> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& qkv_in,
                            int64_t n_head) {
    const at::Tensor qkv = qkv_in.contiguous();
    const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3;
    const HeadShape h = Shape(T, C / n_head);
    at::Tensor p = at::empty({B * n_head, T, T}, qkv.options());
    at::Tensor y = at::empty({B, T, C}, qkv.options());
    const float* in = qkv.data_ptr<float>();
    float* pd = p.data_ptr<float>();
    float* yd = y.data_ptr<float>();
    ParallelForRange(0, B * n_head, 1, at::get_num_threads(), [&](int64_t begin, int64_t end) {
      std::vector<float> kt(h.d_h * h.tp), s(h.tp);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / n_head, head = bh % n_head;
        const float* base = in + b * T * 3 * C + head * h.d_h;
        HeadForward(h, Rows{base, 3 * C}, Rows{base + C, 3 * C}, Rows{base + 2 * C, 3 * C},
                    pd + bh * T * T, yd + b * T * C + head * h.d_h, C, kt.data(), s.data());
      }
    });
    ctx->save_for_backward({qkv, p});
    ctx->saved_data["n_head"] = n_head;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &qkv = saved[0], &p = saved[1];
    const int64_t n_head = ctx->saved_data["n_head"].toInt();
    const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3;
    const HeadShape h = Shape(T, C / n_head);
    const at::Tensor gy = grads[0].contiguous();
    at::Tensor g = at::empty_like(qkv);
    const float* in = qkv.data_ptr<float>();
    const float* pd = p.data_ptr<float>();
    const float* gyd = gy.data_ptr<float>();
    float* gd = g.data_ptr<float>();
    ParallelForRange(0, B * n_head, 1, at::get_num_threads(), [&](int64_t begin, int64_t end) {
      std::vector<float> vt(h.d_h * h.tp), dp(h.tp), row(h.tp), ds(T * h.tp);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / n_head, head = bh % n_head;
        const int64_t offset = b * T * 3 * C + head * h.d_h;
        const float* base = in + offset;
        float* out = gd + offset;
        HeadBackward(h, Rows{base, 3 * C}, Rows{base + C, 3 * C}, Rows{base + 2 * C, 3 * C},
                     pd + bh * T * T, Rows{gyd + b * T * C + head * h.d_h, C}, out, out + C,
                     out + 2 * C, 3 * C, vt.data(), dp.data(), row.data(), ds.data());
      }
    });
    return {g, at::Tensor()};
  }

 private:
  static HeadShape Shape(int64_t t, int64_t d_h) {
    return HeadShape{t, d_h, RoundUp(t, kScoreBlock),
                     static_cast<float>(1.0 / std::sqrt(static_cast<double>(d_h)))};
  }
};

// The B·H heads split into one block per thread, forward and backward; the
// same products and elementwise ops as at::matmul and autograd, in the same
// order.
class CausalAttention : public torch::autograd::Function<CausalAttention> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q_in,
                            const at::Tensor& k_in, const at::Tensor& v_in) {
    const int64_t B = q_in.size(0), H = q_in.size(1), T = q_in.size(2), D = q_in.size(3);
    const at::Tensor q = q_in.reshape({B * H, T, D}), k = k_in.reshape({B * H, T, D}),
                     v = v_in.reshape({B * H, T, D});
    const double scale = std::sqrt(static_cast<double>(D));
    const at::Tensor mask = at::ones({T, T}, q.options().dtype(at::kBool)).triu(1);
    at::Tensor att = at::empty({B * H, T, T}, q.options());
    at::Tensor y = at::empty({B * H, T, D}, q.options());
    ForEachBlock(B * H, q, [&](int64_t begin, int64_t count) {
      at::Tensor att_b = att.narrow(0, begin, count), y_b = y.narrow(0, begin, count);
      const at::Tensor scores =
          at::bmm(q.narrow(0, begin, count), k.narrow(0, begin, count).transpose(1, 2))
              .div_(scale)
              .masked_fill_(mask, -std::numeric_limits<float>::infinity());
      at::_softmax_out(att_b, scores, -1, false);
      at::bmm_out(y_b, att_b, v.narrow(0, begin, count));
    });
    ctx->save_for_backward({q, k, v, att});
    return y.view({B, H, T, D});
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &att = saved[3];
    const int64_t BH = q.size(0), T = q.size(1), D = q.size(2);
    const double scale = std::sqrt(static_cast<double>(D));
    const at::Tensor gy = grads[0].reshape({BH, T, D});
    at::Tensor gq = at::empty_like(q), gk = at::empty_like(k), gv = at::empty_like(v);
    ForEachBlock(BH, q, [&](int64_t begin, int64_t count) {
      const at::Tensor att_b = att.narrow(0, begin, count), gy_b = gy.narrow(0, begin, count);
      at::Tensor gv_b = gv.narrow(0, begin, count), gq_b = gq.narrow(0, begin, count),
                 gk_b = gk.narrow(0, begin, count);
      at::bmm_out(gv_b, att_b.transpose(1, 2), gy_b);
      // Masked entries have att = 0, so their score gradient is 0, as
      // masked_fill's backward makes it.
      const at::Tensor gs =
          at::_softmax_backward_data(at::bmm(gy_b, v.narrow(0, begin, count).transpose(1, 2)),
                                     att_b, -1, att_b.scalar_type())
              .div_(scale);
      at::bmm_out(gq_b, gs, k.narrow(0, begin, count));
      at::bmm_out(gk_b, gs.transpose(1, 2), q.narrow(0, begin, count));
    });
    const int64_t B = grads[0].size(0), H = grads[0].size(1);
    return {gq.view({B, H, T, D}), gk.view({B, H, T, D}), gv.view({B, H, T, D})};
  }

 private:
  // fn(begin, count) on one contiguous block of the `n` heads per thread.
  template <class Fn>
  static void ForEachBlock(int64_t n, const at::Tensor& like, Fn fn) {
    const int64_t blocks = like.is_cpu() ? std::min<int64_t>(n, at::get_num_threads()) : 1;
    const at::ThreadLocalState caller;  // grad mode, dispatch keys: per thread
    ParallelFor(blocks, static_cast<int>(blocks), [&](int64_t b) {
      at::ThreadLocalStateGuard same_state(caller);
      const int64_t begin = n * b / blocks, end = n * (b + 1) / blocks;
      if (end > begin) fn(begin, end - begin);
    });
  }
};

}  // namespace

at::Tensor CausalSelfAttention(const at::Tensor& qkv, int64_t n_head) {
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3, d_h = C / n_head;
  if (qkv.is_cpu() && qkv.scalar_type() == at::kFloat && d_h % kLanes == 0) {
    return PackedCausalAttention::apply(qkv, n_head);
  }
  const auto heads = [&](int i) {
    return qkv.narrow(2, i * C, C).view({B, T, n_head, d_h}).transpose(1, 2);
  };
  return CausalAttention::apply(heads(0), heads(1), heads(2))
      .transpose(1, 2)
      .contiguous()
      .view({B, T, C});
}

bool DecodeAttentionApplies(const at::Tensor& q, const at::Tensor& keys, int64_t n_head) {
  return q.is_cpu() && keys.is_cpu() && q.scalar_type() == at::kFloat &&
         keys.scalar_type() == at::kFloat && q.dim() == 2 && n_head > 0 &&
         q.size(1) % n_head == 0 && (q.size(1) / n_head) % kLanes == 0;
}

at::Tensor DecodeAttention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           absl::Span<const int64_t> slots, absl::Span<const int64_t> lengths,
                           int64_t n_head) {
  TORCH_CHECK(DecodeAttentionApplies(q, keys, n_head) && values.sizes() == keys.sizes() &&
                  keys.dim() == 3 && keys.size(2) == q.size(1) &&
                  static_cast<int64_t>(slots.size()) == q.size(0) &&
                  lengths.size() == slots.size(),
              "DecodeAttention: q [S, C], keys and values [slots, rows, C], S slots and lengths");
  const int64_t S = q.size(0), C = q.size(1), d_h = C / n_head;
  const at::Tensor qc = q.contiguous(), kc = keys.contiguous(), vc = values.contiguous();
  at::Tensor y = at::empty({S, C}, q.options());
  int64_t most = 1;
  for (size_t s = 0; s < slots.size(); ++s) {
    TORCH_CHECK(slots[s] >= 0 && slots[s] < keys.size(0) && lengths[s] >= 1 &&
                    lengths[s] <= keys.size(1),
                "DecodeAttention: sequence ", s, " reads slot ", slots[s], " rows [0, ",
                lengths[s], ") of [", keys.size(0), ", ", keys.size(1), "]");
    most = std::max(most, lengths[s]);
  }
  std::vector<float> scores(RoundUp(most, kLanes));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d_h));
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t slot_size = keys.size(1) * C;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t h = 0; h < n_head; ++h) {
      const int64_t offset = slots[s] * slot_size + h * d_h;
      DecodeHead(qp + s * C + h * d_h, Rows{kp + offset, C}, Rows{vp + offset, C}, lengths[s],
                 d_h, scale, scores.data(), yp + s * C + h * d_h);
    }
  }
  return y;
}

}  // namespace himoe::model
