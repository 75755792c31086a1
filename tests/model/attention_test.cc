#include "model/attention.h"

#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

namespace himoe::model {
namespace {

// The in-process reference: nanoGPT's attention in plain LibTorch ops.
at::Tensor ReferenceAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t T = q.size(2);
  at::Tensor att = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  const at::Tensor mask = at::ones({T, T}, q.options().dtype(at::kBool)).triu(1);
  att = at::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
  return at::matmul(att, v);
}

at::Tensor Heads(const at::Tensor& qkv, int64_t n_head, int i) {
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3;
  return qkv.narrow(2, i * C, C).view({B, T, n_head, C / n_head}).transpose(1, 2);
}

// The reference on qkv [B, T, 3C], heads back side by side: [B, T, C].
at::Tensor ReferencePacked(const at::Tensor& qkv, int64_t n_head) {
  const int64_t B = qkv.size(0), T = qkv.size(1), C = qkv.size(2) / 3;
  return ReferenceAttention(Heads(qkv, n_head, 0), Heads(qkv, n_head, 1), Heads(qkv, n_head, 2))
      .transpose(1, 2)
      .reshape({B, T, C});
}

struct Result {
  at::Tensor y, grad;
};

// y and qkv's gradient under a loss sum(y * weights); the reference in
// double.
Result Attend(const at::Tensor& qkv, int64_t n_head, const at::Tensor& weights, bool reference) {
  const at::ScalarType type = reference ? at::kDouble : qkv.scalar_type();
  const at::Tensor leaf = qkv.to(type).clone().requires_grad_(true);
  const at::Tensor y =
      reference ? ReferencePacked(leaf, n_head) : CausalSelfAttention(leaf, n_head);
  (y * weights.to(type)).sum().backward();
  return {y.detach(), leaf.grad()};
}

double MaxError(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kDouble) - want).abs().max().item<double>();
}

// Head widths that are not a multiple of 16 (here 4) take the per-head bmm
// path: output and qkv's gradient equal the reference at 1, 2 and 3 threads
// (3 blocks of the 5 heads: uneven); the first position attends to itself
// alone (y = v there).
TEST(CausalSelfAttentionTest, MatchesTheReferenceOnEveryThreadCount) {
  const int saved_threads = at::get_num_threads();
  at::manual_seed(3);
  const int64_t B = 5, H = 1, T = 7, D = 4;
  const at::Tensor qkv = at::randn({B, T, 3 * H * D});
  const at::Tensor weights = at::randn({B, T, H * D});
  for (const int threads : {1, 2, 3}) {
    SCOPED_TRACE(threads);
    at::set_num_threads(threads);
    const Result got = Attend(qkv, H, weights, false);
    const Result want = Attend(qkv, H, weights, true);
    ASSERT_EQ(got.y.sizes(), want.y.sizes());
    EXPECT_LE(MaxError(got.y, want.y), 1e-6);
    EXPECT_LE(MaxError(got.grad, want.grad), 1e-6);
    EXPECT_GT(got.grad.abs().sum().item<double>(), 0);
    EXPECT_TRUE(at::allclose(got.y.select(1, 0), qkv.narrow(2, 2 * H * D, H * D).select(1, 0),
                             1e-6, 1e-7));
  }
  at::set_num_threads(saved_threads);
}

// The packed loops (head widths 16, 32 and 48: one, two, and two plus one
// 16-value lanes; lengths below, at and past the 32-key score blocks)
// against the reference in double, output and every part of qkv's gradient, with
// logits large enough that the softmax is far from uniform.
TEST(CausalSelfAttentionTest, PackedLoopsMatchTheReference) {
  at::manual_seed(5);
  for (const int64_t d_h : {16, 32, 48}) {
    for (const int64_t T : {1, 5, 32, 37, 128}) {
      SCOPED_TRACE(testing::Message() << "d_h " << d_h << ", T " << T);
      const int64_t B = 2, H = 3, C = H * d_h;
      const at::Tensor qkv = at::randn({B, T, 3 * C}) * 1.5;
      const at::Tensor weights = at::randn({B, T, C});
      const Result got = Attend(qkv, H, weights, false);
      const Result want = Attend(qkv, H, weights, true);
      ASSERT_EQ(got.y.sizes(), want.y.sizes());
      // Float32 rounding of sums of up to 128 terms of size ~1-5.
      EXPECT_LE(MaxError(got.y, want.y), 2e-6 * (1 + want.y.abs().max().item<double>()));
      for (int part = 0; part < 3; ++part) {  // q, k, v
        const at::Tensor g = got.grad.narrow(2, part * C, C);
        const at::Tensor w = want.grad.narrow(2, part * C, C);
        EXPECT_LE(MaxError(g, w), 2e-6 * (1 + w.abs().max().item<double>())) << "part " << part;
      }
      // Position 0 sees itself alone: y = v, and q gets no gradient there.
      EXPECT_TRUE(at::allclose(got.y.select(1, 0), qkv.narrow(2, 2 * C, C).select(1, 0), 1e-6,
                               1e-6));
      EXPECT_EQ(got.grad.narrow(2, 0, C).select(1, 0).abs().max().item<double>(), 0.0);
    }
  }
}

// A head's result is its own: 1 and 2 threads give the same bits, and a
// query's output does not depend on the positions after it.
TEST(CausalSelfAttentionTest, PackedLoopsSameBitsOnAnyThreadCount) {
  const int saved_threads = at::get_num_threads();
  at::manual_seed(9);
  const int64_t B = 3, H = 4, T = 50, C = H * 32;
  const at::Tensor qkv = at::randn({B, T, 3 * C});
  const at::Tensor weights = at::randn({B, T, C});
  at::set_num_threads(1);
  const Result one = Attend(qkv, H, weights, false);
  at::set_num_threads(2);
  const Result two = Attend(qkv, H, weights, false);
  at::set_num_threads(saved_threads);
  EXPECT_TRUE(at::equal(one.y, two.y));
  EXPECT_TRUE(at::equal(one.grad, two.grad));
  at::NoGradGuard no_grad;
  const at::Tensor prefix = CausalSelfAttention(qkv.narrow(1, 0, 20).contiguous(), H);
  EXPECT_TRUE(at::equal(prefix, one.y.narrow(1, 0, 20)));
}


// Decoding: softmax(q kᵀ / sqrt(d_h)) v per head over each sequence's own
// cached rows, computed in double with LibTorch ops.
at::Tensor ReferenceDecode(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           const std::vector<int64_t>& slots, const std::vector<int64_t>& lengths,
                           int64_t H) {
  const int64_t C = q.size(1), d_h = C / H;
  std::vector<at::Tensor> rows;
  for (size_t s = 0; s < slots.size(); ++s) {
    const auto heads = [&](const at::Tensor& pooled) {  // [H, length, d_h]
      return pooled.select(0, slots[s]).narrow(0, 0, lengths[s]).to(at::kDouble)
          .view({lengths[s], H, d_h}).transpose(0, 1);
    };
    const at::Tensor qs = q[s].to(at::kDouble).view({H, 1, d_h});
    const at::Tensor att = at::softmax(
        at::matmul(qs, heads(keys).transpose(-2, -1)) / std::sqrt(static_cast<double>(d_h)), -1);
    rows.push_back(at::matmul(att, heads(values)).view({C}));
  }
  return at::stack(rows);
}

// Sequences of different lengths in scattered slots (a length-1 one sees only
// its own key: y = v there) equal the reference; rows past a sequence's
// length, filled with garbage, change nothing.
TEST(DecodeAttentionTest, MatchesTheReference) {
  at::manual_seed(3);
  for (const int64_t d_h : {16, 32, 64}) {
    SCOPED_TRACE(testing::Message() << "d_h " << d_h);
    const int64_t H = 3, C = H * d_h, slots = 6, rows = 70;
    const at::Tensor keys = at::randn({slots, rows, C}) * 1.5;
    const at::Tensor values = at::randn({slots, rows, C});
    const std::vector<int64_t> slot = {4, 0, 5, 2}, length = {70, 1, 33, 17};
    const at::Tensor q = at::randn({4, C}) * 1.5;
    ASSERT_TRUE(DecodeAttentionApplies(q, keys, H));
    const at::Tensor got = DecodeAttention(q, keys, values, slot, length, H);
    const at::Tensor want = ReferenceDecode(q, keys, values, slot, length, H);
    EXPECT_LE(MaxError(got, want), 2e-6 * (1 + want.abs().max().item<double>()));
    EXPECT_TRUE(at::allclose(got[1], values[0][0], 1e-6, 1e-6));
    at::Tensor dirty_keys = keys.clone(), dirty_values = values.clone();
    dirty_keys[2].narrow(0, 33, rows - 33).fill_(1e30);
    dirty_values[2].narrow(0, 33, rows - 33).fill_(std::numeric_limits<float>::quiet_NaN());
    EXPECT_TRUE(at::equal(DecodeAttention(q, dirty_keys, dirty_values, slot, length, H), got));
  }
}

// A sequence's row has the same bits alone as beside others.
TEST(DecodeAttentionTest, EachRowHasItsBitsInAnyBatch) {
  at::manual_seed(4);
  const int64_t H = 4, C = H * 32;
  const at::Tensor keys = at::randn({5, 40, C}), values = at::randn({5, 40, C});
  const at::Tensor q = at::randn({5, C});
  const std::vector<int64_t> slot = {3, 1, 4, 0, 2}, length = {40, 9, 23, 2, 31};
  const at::Tensor together = DecodeAttention(q, keys, values, slot, length, H);
  for (size_t s = 0; s < slot.size(); ++s) {
    const at::Tensor alone = DecodeAttention(q.narrow(0, s, 1), keys, values, {slot[s]},
                                             {length[s]}, H);
    EXPECT_TRUE(at::equal(alone[0], together[s])) << "sequence " << s;
  }
}

// Only float32 CPU rows with heads a multiple of 16 wide take the loops; a
// slot or length outside the pool is an error, not a read past it.
TEST(DecodeAttentionTest, AppliesOnlyWhereItCanAndChecksItsReads) {
  const at::Tensor keys = at::zeros({2, 8, 64});
  EXPECT_TRUE(DecodeAttentionApplies(at::zeros({1, 64}), keys, 4));
  EXPECT_FALSE(DecodeAttentionApplies(at::zeros({1, 64}), keys, 8));  // d_h 8
  EXPECT_FALSE(DecodeAttentionApplies(at::zeros({1, 64}, at::kDouble), keys, 4));
  const at::Tensor q = at::zeros({1, 64});
  EXPECT_THROW(DecodeAttention(q, keys, keys, {2}, {1}, 4), c10::Error);
  EXPECT_THROW(DecodeAttention(q, keys, keys, {1}, {9}, 4), c10::Error);
  EXPECT_THROW(DecodeAttention(q, keys, keys, {1}, {0}, 4), c10::Error);
}

}  // namespace
}  // namespace himoe::model
