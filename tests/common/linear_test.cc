#include "common/linear.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>

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
  at::manual_seed(3);
  const at::Tensor w = at::randn({48, 32}), b = at::randn({48});
  for (int64_t rows = 0; rows <= 2 * kRowwiseLinearRowsWhenFaster; ++rows) {
    const at::Tensor x = at::randn({rows, 32});
    for (const bool with_bias : {true, false}) {
      const at::Tensor bias = with_bias ? b : at::Tensor();
      const at::Tensor got = Linear(x, w, bias);
      const at::Tensor want = at::linear(x, w, bias);
      ASSERT_EQ(got.sizes(), want.sizes()) << rows << " rows";
      EXPECT_TRUE(at::allclose(got, want, 1e-5, 1e-5)) << rows << " rows";
    }
    const at::Tensor xg = x.clone().requires_grad_(true), wg = w.clone().requires_grad_(true);
    const at::Tensor xr = x.clone().requires_grad_(true), wr = w.clone().requires_grad_(true);
    (Linear(xg, wg, b) * 1.5).sum().backward();
    (at::linear(xr, wr, b) * 1.5).sum().backward();
    EXPECT_TRUE(at::allclose(wg.grad(), wr.grad(), 1e-5, 1e-5)) << rows << " rows";
    if (rows > 0) {
      EXPECT_TRUE(at::allclose(xg.grad(), xr.grad(), 1e-5, 1e-5)) << rows << " rows";
    }
  }
}

// Below the switch a row's result is exactly what it is alone (the weight has
// an odd row count: both output blocks).
TEST_F(LinearTest, FewRowsDoNotDependOnTheRowsBesideThem) {
  at::manual_seed(4);
  const at::Tensor w = at::randn({255, 128}), b = at::randn({255});
  const at::Tensor x = at::randn({kRowwiseLinearRowsWhenFaster - 1, 128});
  const at::Tensor together = Linear(x, w, b);
  for (int64_t i = 0; i < x.size(0); ++i) {
    EXPECT_TRUE(at::equal(together[i], Linear(x.narrow(0, i, 1), w, b)[0])) << "row " << i;
  }
}

// The small-rows product against the sums in double precision, at every row
// count of its blocks (4, 2, 1 rows; 4 and 1 outputs), with and without a bias.
TEST_F(LinearTest, SmallRowsProductIsTheProductInDouble) {
  at::manual_seed(6);
  const at::Tensor w = at::randn({47, 48}), b = at::randn({47});
  for (int64_t rows = 1; rows <= 17; ++rows) {
    const at::Tensor x = at::randn({rows, 48});
    for (const bool with_bias : {true, false}) {
      const at::Tensor bias = with_bias ? b : at::Tensor();
      ASSERT_TRUE(SmallRowsLinearApplies(x, w, bias));
      at::Tensor want = at::mm(x.to(at::kDouble), w.to(at::kDouble).t());
      if (with_bias) want = want + b.to(at::kDouble);
      const at::Tensor got = SmallRowsLinear(x, w, bias);
      ASSERT_EQ(got.sizes(), want.sizes());
      EXPECT_LT((got.to(at::kDouble) - want).abs().max().item<double>(), 1e-5)
          << rows << " rows, bias " << with_bias;
    }
  }
}

// An output's bits do not depend on the outputs computed beside it either:
// in a block of 4 (their lane sums reduced together) or alone (the tail).
TEST_F(LinearTest, SmallRowsOutputsDoNotDependOnTheOutputsBesideThem) {
  at::manual_seed(8);
  const at::Tensor w = at::randn({9, 64}), b = at::randn({9});
  const at::Tensor x = at::randn({5, 64});
  const at::Tensor together = SmallRowsLinear(x, w, b);
  for (int64_t n = 0; n < w.size(0); ++n) {
    const at::Tensor alone = SmallRowsLinear(x, w.narrow(0, n, 1), b.narrow(0, n, 1));
    EXPECT_TRUE(at::equal(together.narrow(1, n, 1), alone)) << "output " << n;
  }
}

// Where it does not apply, Linear is still the product: rows of 40 (not a
// multiple of 16), a transposed weight, doubles, or autograd recording.
TEST_F(LinearTest, SmallRowsProductOnlyWhereItApplies) {
  at::manual_seed(7);
  const at::Tensor x = at::randn({3, 48}), w = at::randn({20, 48}), b = at::randn({20});
  EXPECT_FALSE(SmallRowsLinearApplies(at::randn({3, 40}), at::randn({20, 40}), b));
  EXPECT_FALSE(SmallRowsLinearApplies(x, at::randn({48, 20}).t(), b));
  EXPECT_FALSE(SmallRowsLinearApplies(x.to(at::kDouble), w.to(at::kDouble), b.to(at::kDouble)));
  EXPECT_FALSE(SmallRowsLinearApplies(x, w.clone().requires_grad_(true), b));
  {
    at::NoGradGuard no_grad;
    EXPECT_TRUE(SmallRowsLinearApplies(x, w.clone().requires_grad_(true), b));
  }
  const at::Tensor wt = at::randn({48, 20});
  EXPECT_TRUE(at::allclose(Linear(x, wt.t(), b), at::linear(x, wt.t(), b), 1e-5, 1e-5));
}

TEST_F(LinearTest, TurnedOffItIsAtLinear) {
  SetRowwiseLinearRows(0);
  at::manual_seed(5);
  const at::Tensor w = at::randn({64, 32}), b = at::randn({64});
  const at::Tensor x = at::randn({3, 32});
  EXPECT_TRUE(at::equal(Linear(x, w, b), at::linear(x, w, b)));
}

// The same on a GPU, where it is at::linear.
TEST_F(LinearTest, OnCudaItIsAtLinear) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const at::Tensor w = at::randn({16, 8}, cuda), b = at::randn({16}, cuda);
  const at::Tensor x = at::randn({3, 8}, cuda);
  EXPECT_TRUE(at::equal(Linear(x, w, b), at::linear(x, w, b)));
}

}  // namespace
}  // namespace himoe
