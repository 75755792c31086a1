#ifndef HIMOE_COMMON_MATMUL_H_
#define HIMOE_COMMON_MATMUL_H_

#include <ATen/core/Tensor.h>

namespace himoe {

// out = beta * out + a b for a [m, k], b [k, n] and float32 out [m, n], each
// a matrix or its transpose in memory (one unit stride), with float32 a and
// b rounded to bfloat16 (nearest even; bfloat16 ones as they are, so an
// operand used twice is rounded once) and the products summed in float32:
// PyTorch's torch.set_float32_matmul_precision("medium"). On the CPU this is
// oneDNN's bf16 GEMM with a float32 result, twice fp32's rate on vector
// units with bf16 dot products (AVX512_BF16, AMX); elsewhere, or without
// oneDNN, the rounded operands go through the float32 GEMM (the same
// rounding, float32's speed).
void MatmulBf16Out(at::Tensor& out, const at::Tensor& a, const at::Tensor& b, float beta);

// x [..., K] times weight [N, K] transposed, plus bias [N] (or undefined),
// every product (forward and backward) MatmulBf16Out's; differentiable in
// x, weight and bias. For float32 tensors.
at::Tensor LinearBf16(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

// Whether MatmulBf16Out's CPU products run on oneDNN's bf16 GEMM (false:
// built without oneDNN, or oneDNN has no bf16 GEMM for this CPU).
bool Bf16GemmNative();

// Off: MatmulBf16Out takes its other path (rounded operands through the
// float32 GEMM) even where oneDNN's applies; for comparisons. On by default.
void SetBf16GemmNativeEnabled(bool enabled);

}  // namespace himoe

#endif  // HIMOE_COMMON_MATMUL_H_
