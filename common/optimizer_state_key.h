#ifndef HIMOE_COMMON_OPTIMIZER_STATE_KEY_H_
#define HIMOE_COMMON_OPTIMIZER_STATE_KEY_H_

#include <sstream>
#include <string>
#include <type_traits>

namespace himoe {

// The key a LibTorch optimizer files a parameter's state under, given the
// parameter's TensorImpl address: that address as text up to LibTorch 1.13
// (c10::guts::to_string), the address itself from 2.x. `Key` is the state
// map's key_type.
template <typename Key>
Key OptimizerStateKey(const void* tensor_impl) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;
    text << tensor_impl;
    return text.str();
  } else {
    return static_cast<Key>(const_cast<void*>(tensor_impl));
  }
}

// An AdamW parameter state as named tensors: "<param>.exp_avg",
// "<param>.exp_avg_sq" and "<param>.step" (an int64 scalar), all three or
// none (the trainer's optimizer.pt, the expert groups' GetState/SetState).
inline constexpr const char* kAdamWStateFields[] = {"exp_avg", "exp_avg_sq", "step"};

// Splits "layer0.w1.exp_avg" into ("layer0.w1", "exp_avg"); false when the
// suffix is not one of kAdamWStateFields or the parameter name is empty.
inline bool SplitAdamWStateName(const std::string& name, std::string* param, std::string* field) {
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos || dot == 0) return false;
  const std::string suffix = name.substr(dot + 1);
  for (const char* f : kAdamWStateFields) {
    if (suffix == f) {
      *param = name.substr(0, dot);
      *field = suffix;
      return true;
    }
  }
  return false;
}

}  // namespace himoe

#endif  // HIMOE_COMMON_OPTIMIZER_STATE_KEY_H_
