#ifndef HIMOE_COMMON_LINEAR_H_
#define HIMOE_COMMON_LINEAR_H_

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace himoe {

// Products of fewer rows than this run as one GEMV per row on the CPU; 0 (the
// default) = never. The compute set-up sets it from a measurement
// (SmallProductsRowwise in common/compute_setup.h).
int64_t RowwiseLinearRows();
void SetRowwiseLinearRows(int64_t rows);

// The row count below which rowwise pays where it pays at all: BLAS GEMMs
// without a small-matrix path pack the whole weight per call.
inline constexpr int64_t kRowwiseLinearRowsWhenFaster = 8;

// at::linear(x, weight, bias) (bias may be undefined). For a 2-D `x` of fewer
// than RowwiseLinearRows() rows on the CPU, each row is its own GEMV: BLIS
// kernel sets without small-matrix ("sup") kernels pack the whole weight for
// every GEMM, which at a few rows costs several times the product (skx, d 256
// x 1024 float32, one thread: a GEMM of 2 rows 150 us, two GEMVs 28 us). A
// row's result then does not depend on the rows beside it. Differentiable
// either way.
at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

}  // namespace himoe

#endif  // HIMOE_COMMON_LINEAR_H_
