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

}  // namespace himoe

#endif  // HIMOE_COMMON_OPTIMIZER_STATE_KEY_H_
