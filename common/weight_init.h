#ifndef HIMOE_COMMON_WEIGHT_INIT_H_
#define HIMOE_COMMON_WEIGHT_INIT_H_

#include <cstdint>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

namespace himoe {

// The released code's switch_tfm_init_scale.
inline constexpr double kSwitchInitScale = 0.1;

// Fills `t` in place with a normal of mean 0 and `std` truncated to
// [-2 std, 2 std], as torch.nn.init.trunc_normal_(t, 0, std, -2 std, 2 std)
// does (inverse CDF of a uniform draw); its standard deviation is then
// 0.8796 std.
void TruncatedNormal_(at::Tensor& t, double std, at::Generator& gen);

// Switch Transformer's init (Fedus et al. 2021, p. 10): truncated normal of
// std sqrt(kSwitchInitScale / fan_in).
void SwitchInit_(at::Tensor& t, int64_t fan_in, at::Generator& gen);

// GPT-2's residual-projection std, 0.02 / sqrt(2 n_layer).
double ResidualInitStd(int n_layer);

}  // namespace himoe

#endif  // HIMOE_COMMON_WEIGHT_INIT_H_
