#ifndef HIMOE_COMMON_LINEAR_H_
#define HIMOE_COMMON_LINEAR_H_

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace himoe {

// Products of fewer rows than this run through the small-rows product (or a
// GEMV per row) on the CPU; 0 (the default) = never. The compute set-up sets
// it from a measurement (ChooseSmallProducts, common/small_product_choice.h).
int64_t RowwiseLinearRows();
void SetRowwiseLinearRows(int64_t rows);

// The row count below which the small-rows product pays where it pays at
// all: BLAS GEMMs without a small-matrix path pack the whole weight per call,
// and the small-rows product's time grows with the rows (see
// docs/benchmarks.md, Measurements behind choices in the code).
inline constexpr int64_t kRowwiseLinearRowsWhenFaster = 16;

// at::linear(x, weight, bias) (bias may be undefined). For a 2-D `x` of fewer
// than RowwiseLinearRows() rows on the CPU it is SmallRowsLinear where that
// applies, else one GEMV per row: BLIS kernel sets without small-matrix
// ("sup") kernels pack the whole weight for every GEMM, which at a few rows
// costs several times the product (see docs/benchmarks.md, Measurements
// behind choices in the code). A row's result then does not depend on the
// rows beside it. Differentiable
// either way (with autograd recording, rowwise GEMVs).
at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

// x [R, K] times weight [N, K] transposed, plus bias [N] (or undefined), by
// this file's own loop: each output one 16-lane dot product summed in a fixed
// order, the weight read once per 4 rows. For a few rows, where BLAS packs or
// rereads the weight. Applies to float32 CPU tensors, a contiguous weight,
// K % 16 == 0, and no autograd recording.
bool SmallRowsLinearApplies(const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias);
at::Tensor SmallRowsLinear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

}  // namespace himoe

#endif  // HIMOE_COMMON_LINEAR_H_
