#ifndef HIMOE_COMMON_NAMED_TENSOR_H_
#define HIMOE_COMMON_NAMED_TENSOR_H_

#include <string>
#include <utility>

#include <ATen/core/Tensor.h>

namespace himoe {

// A tensor with its state name, e.g. ("layer0.w1", w1): expert state,
// checkpoints, state streaming.
using NamedTensor = std::pair<std::string, at::Tensor>;

}  // namespace himoe

#endif  // HIMOE_COMMON_NAMED_TENSOR_H_
