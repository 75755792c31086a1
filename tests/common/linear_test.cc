#include "common/linear.h"

#include <torch/torch.h>

#include <cstdint>

#include "gtest/gtest.h"

namespace himoe {
namespace {

// Turns the rowwise path on for one test.
class LinearTest : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_ = RowwiseLinearRows();
    SetRowwiseLinearRows(kRowwiseLinearRowsWhenFaster);
  }
  void TearDown() override { SetRowwiseLinearRows(saved_); }

 private:
  int64_t saved_ = 0;
};

// Against LibTorch's own at::linear, at every row count around the switch
// to one GEMV per row, with and without a bias, values and gradients.
TEST_F(LinearTest, EqualsAtLinearForEveryRowCount) {
  torch::manual_seed(3);
  const at::Tensor w = torch::randn({48, 32}), b = torch::randn({48});
  for (int64_t rows = 0; rows <= 2 * kRowwiseLinearRowsWhenFaster; ++rows) {
    const at::Tensor x = torch::randn({rows, 32});
    for (const bool with_bias : {true, false}) {
      const at::Tensor bias = with_bias ? b : at::Tensor();
      const at::Tensor got = Linear(x, w, bias);
      const at::Tensor want = at::linear(x, w, bias);
      ASSERT_EQ(got.sizes(), want.sizes()) << rows << " rows";
      EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5)) << rows << " rows";
    }
    const at::Tensor xg = x.clone().requires_grad_(true), wg = w.clone().requires_grad_(true);
    const at::Tensor xr = x.clone().requires_grad_(true), wr = w.clone().requires_grad_(true);
    (Linear(xg, wg, b) * 1.5).sum().backward();
    (at::linear(xr, wr, b) * 1.5).sum().backward();
    EXPECT_TRUE(torch::allclose(wg.grad(), wr.grad(), 1e-5, 1e-5)) << rows << " rows";
    if (rows > 0) {
      EXPECT_TRUE(torch::allclose(xg.grad(), xr.grad(), 1e-5, 1e-5)) << rows << " rows";
    }
  }
}

// Below the switch a row's result is exactly what it is alone.
TEST_F(LinearTest, FewRowsDoNotDependOnTheRowsBesideThem) {
  torch::manual_seed(4);
  const at::Tensor w = torch::randn({256, 128}), b = torch::randn({256});
  const at::Tensor x = torch::randn({kRowwiseLinearRowsWhenFaster - 1, 128});
  const at::Tensor together = Linear(x, w, b);
  for (int64_t i = 0; i < x.size(0); ++i) {
    EXPECT_TRUE(torch::equal(together[i], Linear(x.narrow(0, i, 1), w, b)[0])) << "row " << i;
  }
}

TEST_F(LinearTest, TurnedOffItIsAtLinear) {
  SetRowwiseLinearRows(0);
  torch::manual_seed(5);
  const at::Tensor w = torch::randn({64, 32}), b = torch::randn({64});
  const at::Tensor x = torch::randn({3, 32});
  EXPECT_TRUE(torch::equal(Linear(x, w, b), at::linear(x, w, b)));
}

// The same on a GPU, where it is at::linear.
TEST_F(LinearTest, OnCudaItIsAtLinear) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const at::Tensor w = torch::randn({16, 8}, cuda), b = torch::randn({16}, cuda);
  const at::Tensor x = torch::randn({3, 8}, cuda);
  EXPECT_TRUE(torch::equal(Linear(x, w, b), at::linear(x, w, b)));
}

}  // namespace
}  // namespace himoe
