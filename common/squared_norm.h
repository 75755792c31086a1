#ifndef HIMOE_COMMON_SQUARED_NORM_H_
#define HIMOE_COMMON_SQUARED_NORM_H_

#include <ATen/core/Tensor.h>

namespace himoe {

// sum_i t_i^2 in double (the gradient-clipping norm, squared). A float CPU
// tensor is read once: blocks of kSquaredNormBlock elements each sum their
// squares in order, in parallel, and the block sums add in order, so the
// result does not depend on the thread count. Elsewhere (other dtypes,
// devices): t.to(double).square().sum().
double SquaredNorm(const at::Tensor& t);

inline constexpr int64_t kSquaredNormBlock = 1 << 14;

}  // namespace himoe

#endif  // HIMOE_COMMON_SQUARED_NORM_H_
