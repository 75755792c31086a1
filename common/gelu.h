#ifndef HIMOE_COMMON_GELU_H_
#define HIMOE_COMMON_GELU_H_

#include <ATen/core/Tensor.h>

namespace himoe {

// The exact GELU of the expert FFN, gelu(x) = x Phi(x) (Phi the standard
// normal CDF, through erf), into `out` (same shape as `in`), and its backward,
// out = grad (Phi(x) + x phi(x)). Float32 contiguous CPU tensors take this
// file's vector loop: erf by Abramowitz and Stegun 7.1.26 (|error| < 1.5e-7,
// the formula of ATen's vectorised erf) with exp(-x^2/2) computed once for
// both Phi and phi; within 1e-6 of the double-precision GELU, as at::gelu is,
// and a value's result does not depend on its neighbours or the thread count.
// LibTorch's own GELU is several times slower per value on its native kernel
// and goes through oneDNN, which JIT-compiles a kernel per shape (see
// docs/benchmarks.md, Measurements behind choices in the code). Other
// tensors: at::gelu_out / at::gelu_backward_out on fixed tiles of rows, so
// oneDNN meets at most a few shapes.
void GeluOut(at::Tensor& out, const at::Tensor& in);
void GeluBackwardOut(at::Tensor& out, const at::Tensor& grad, const at::Tensor& in);

}  // namespace himoe

#endif  // HIMOE_COMMON_GELU_H_
