#include "common/optimizer_state_key.h"

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <type_traits>
#include <vector>

#include "gtest/gtest.h"

namespace himoe {
namespace {

// The key finds the state AdamW itself filed for each parameter after a step
// (text of the TensorImpl address on LibTorch 1.13, the address on 2.x), and
// only that parameter's.
TEST(OptimizerStateKeyTest, FindsTheStateTorchFiledForEachParameter) {
  at::Tensor a = at::ones({3}).requires_grad_();
  at::Tensor b = at::ones({2, 2}).requires_grad_();
  torch::optim::AdamW adamw(std::vector<at::Tensor>{a, b}, torch::optim::AdamWOptions(0.1));
  (a.sum() + 2 * b.sum()).backward();
  adamw.step();
  using Key = std::decay_t<decltype(adamw.state())>::key_type;
  ASSERT_EQ(adamw.state().size(), 2u);
  for (const at::Tensor& p : {a, b}) {
    const auto it = adamw.state().find(OptimizerStateKey<Key>(p.unsafeGetTensorImpl()));
    ASSERT_NE(it, adamw.state().end());
    const auto& state = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    EXPECT_EQ(state.step(), 1);
    EXPECT_TRUE(state.exp_avg().sizes().equals(p.sizes()));
    // AdamW's first moment after one step: (1 - beta1) * grad.
    EXPECT_TRUE(at::allclose(state.exp_avg(), 0.1 * p.grad()));
  }
  const at::Tensor other = at::ones({3});
  EXPECT_EQ(adamw.state().count(OptimizerStateKey<Key>(other.unsafeGetTensorImpl())), 0u);
}

}  // namespace
}  // namespace himoe
