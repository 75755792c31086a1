#include "model/attention.h"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>
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

// Output and the gradients of q, k and v equal the reference at 1, 2 and 3
// threads (3 blocks of the 5 heads: uneven), on transposed views as the LM
// passes them; the first position attends to itself alone (y = v there).
TEST(CausalSelfAttentionTest, MatchesTheReferenceOnEveryThreadCount) {
  const int saved_threads = at::get_num_threads();
  at::manual_seed(3);
  const int64_t B = 5, H = 1, T = 7, D = 4;
  const at::Tensor qkv = at::randn({B, T, 3 * H * D});
  const at::Tensor weights = at::randn({B, H, T, D});
  for (const int threads : {1, 2, 3}) {
    SCOPED_TRACE(threads);
    at::set_num_threads(threads);
    const auto heads = [&](const at::Tensor& t, int i) {
      return t.narrow(2, i * H * D, H * D).view({B, T, H, D}).transpose(1, 2);
    };
    const at::Tensor leaf = qkv.clone().requires_grad_(true);
    const at::Tensor y = CausalSelfAttention(heads(leaf, 0), heads(leaf, 1), heads(leaf, 2));
    (y * weights).sum().backward();
    const at::Tensor ref_leaf = qkv.clone().requires_grad_(true);
    const at::Tensor want =
        ReferenceAttention(heads(ref_leaf, 0), heads(ref_leaf, 1), heads(ref_leaf, 2));
    (want * weights).sum().backward();

    ASSERT_EQ(y.sizes(), want.sizes());
    EXPECT_LE((y - want).abs().max().item<double>(), 1e-6);
    EXPECT_LE((leaf.grad() - ref_leaf.grad()).abs().max().item<double>(), 1e-6);
    EXPECT_GT(leaf.grad().abs().sum().item<double>(), 0);
    EXPECT_TRUE(at::allclose(y.select(2, 0), heads(qkv, 2).select(2, 0), 1e-6, 1e-7));
  }
  at::set_num_threads(saved_threads);
}

}  // namespace
}  // namespace himoe::model
