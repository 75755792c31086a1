#include "common/optimizer_state_key.h"

#include <torch/torch.h>

#include <type_traits>
#include <vector>

#include "gtest/gtest.h"

namespace himoe {
namespace {

// The key finds the state AdamW itself filed for each parameter after a step
// (text of the TensorImpl address on LibTorch 1.13, the address on 2.x), and
// only that parameter's.
TEST(OptimizerStateKeyTest, FindsTheStateTorchFiledForEachParameter) {
  at::Tensor a = torch::ones({3}, torch::requires_grad());
  at::Tensor b = torch::ones({2, 2}, torch::requires_grad());
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
    EXPECT_TRUE(torch::allclose(state.exp_avg(), 0.1 * p.grad()));
  }
  const at::Tensor other = torch::ones({3});
  EXPECT_EQ(adamw.state().count(OptimizerStateKey<Key>(other.unsafeGetTensorImpl())), 0u);
}

}  // namespace
}  // namespace himoe
