#ifndef HIMOE_COMMON_ALL_FINITE_H_
#define HIMOE_COMMON_ALL_FINITE_H_

#include <ATen/core/Tensor.h>

namespace himoe {

// at::isfinite(t).all(): no element is NaN or +-Inf (true when empty and for
// integer and bool tensors). A CPU tensor of a floating type is read once, its
// exponent bits tested in place; at::isfinite allocates and fills a mask from
// several passes (about 10 LibTorch ops, which dominate for a decoding step's
// one row). Other devices: at::isfinite.
bool AllFinite(const at::Tensor& t);

}  // namespace himoe

#endif  // HIMOE_COMMON_ALL_FINITE_H_
