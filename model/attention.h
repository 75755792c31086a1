#ifndef HIMOE_MODEL_ATTENTION_H_
#define HIMOE_MODEL_ATTENTION_H_

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "absl/types/span.h"

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

// Decoding with a KV cache: one query per sequence, q [S, C], against the
// first lengths[s] rows of slot slots[s] of the pooled keys and values
// [slots, rows, C] (head h at columns h·d_h): softmax(q kᵀ / sqrt(d_h)) v per
// head, [S, C]. Each sequence's row is computed on its own, so it has the
// same bits in any batch. Float32 CPU tensors with d_h a multiple of 16 only
// (DecodeAttentionApplies): the project's loops, where gathering the keys and
// batched products of one query row cost more than the arithmetic.
bool DecodeAttentionApplies(const at::Tensor& q, const at::Tensor& keys, int64_t n_head);
at::Tensor DecodeAttention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                           absl::Span<const int64_t> slots, absl::Span<const int64_t> lengths,
                           int64_t n_head);

}  // namespace himoe::model

#endif  // HIMOE_MODEL_ATTENTION_H_
