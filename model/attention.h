#ifndef HIMOE_MODEL_ATTENTION_H_
#define HIMOE_MODEL_ATTENTION_H_

#include <ATen/core/Tensor.h>

namespace himoe::model {

// Causal softmax attention, softmax(q kᵀ / sqrt(d_h) with the future masked)
// v, on heads q, k, v of [B, H, T, d_h]; returns [B, H, T, d_h].
// Differentiable. On the CPU with several threads the B·H heads are split
// into one block per thread, each product on one thread: a [T, d_h] x
// [d_h, T] product is too small for BLIS to split well across threads.
at::Tensor CausalSelfAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

}  // namespace himoe::model

#endif  // HIMOE_MODEL_ATTENTION_H_
