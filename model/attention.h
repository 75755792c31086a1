#ifndef HIMOE_MODEL_ATTENTION_H_
#define HIMOE_MODEL_ATTENTION_H_

#include <ATen/core/Tensor.h>

namespace himoe::model {

// Causal softmax attention, softmax(q kᵀ / sqrt(d_h) with the future masked)
// v, per head, on a block's packed projection qkv [B, T, 3C] (q, k, v side
// by side; head h at columns h·d_h of each, d_h = C / n_head); returns the
// heads side by side, [B, T, C]. Differentiable. Float32 CPU tensors with
// d_h a multiple of 16 take the project's own loops: each head on one
// thread, the scores of query i only against keys 0..i, read from and
// written to the packed layout (no per-head copies). Elsewhere: at::bmm and
// softmax per head, the heads split into one block per thread on the CPU (a
// [T, d_h] x [d_h, T] product is too small for BLIS to split well).
at::Tensor CausalSelfAttention(const at::Tensor& qkv, int64_t n_head);

}  // namespace himoe::model

#endif  // HIMOE_MODEL_ATTENTION_H_
