#include "common/gelu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "gtest/gtest.h"

namespace himoe {
namespace {

// The oracle: the exact GELU and its derivative, in double, by hand.
double GeluDouble(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }
double GeluGradDouble(double x) {
  return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) +
         x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
}

at::Tensor Map(const at::Tensor& x, double (*f)(double)) {
  at::Tensor out = at::empty(x.sizes(), at::kDouble);
  const at::Tensor xd = x.to(at::kDouble).contiguous();
  for (int64_t i = 0; i < x.numel(); ++i) {
    out.data_ptr<double>()[i] = f(xd.data_ptr<double>()[i]);
  }
  return out;
}

double MaxAbsError(const at::Tensor& got, const at::Tensor& want) {
  return (got.to(at::kDouble) - want).abs().max().item<double>();
}

// The float32 loop against the double formula over [-12, 12] (past both
// tails: 0 below, x above), at sizes that are and are not multiples of the
// 16-value lanes. The bound is 2 float32 ulps of 8; at::gelu's own error
// on these inputs is under it as well.
TEST(GeluTest, IsTheExactGeluInDouble) {
  for (const int64_t n : {1, 15, 16, 17, 1000, 4096 + 5}) {
    const at::Tensor x = at::linspace(-12.0, 12.0, n);
    at::Tensor y = at::empty_like(x);
    GeluOut(y, x);
    const at::Tensor want = Map(x, GeluDouble);
    EXPECT_LT(MaxAbsError(y, want), 1e-6) << n << " values";
    EXPECT_LT(MaxAbsError(at::gelu(x), want), 1e-6) << n << " values";
    // Relative where the value is small: near 0 GELU is x/2.
    const at::Tensor small = at::linspace(-1e-3, 1e-3, n);
    at::Tensor ys = at::empty_like(small);
    GeluOut(ys, small);
    EXPECT_LT(MaxAbsError(ys, Map(small, GeluDouble)), 1e-9) << n << " values";
  }
  at::manual_seed(1);
  const at::Tensor x = at::randn({256, 512}) * 3;
  at::Tensor y = at::empty_like(x);
  GeluOut(y, x);
  EXPECT_LT(MaxAbsError(y, Map(x, GeluDouble)), 1e-6);
}

TEST(GeluTest, BackwardIsTheDerivativeInDouble) {
  at::manual_seed(2);
  for (const int64_t n : {1, 15, 16, 33, 4096 + 7}) {
    const at::Tensor x = at::linspace(-12.0, 12.0, n);
    const at::Tensor grad = at::randn({n});
    at::Tensor g = at::empty_like(x);
    GeluBackwardOut(g, grad, x);
    const at::Tensor want = grad.to(at::kDouble) * Map(x, GeluGradDouble);
    EXPECT_LT(MaxAbsError(g, want), 2e-6 * grad.abs().max().item<double>()) << n << " values";
  }
  // In place over the incoming gradient, as the expert FFN's backward calls it.
  const at::Tensor x = at::randn({64, 48});
  at::Tensor grad = at::randn({64, 48});
  const at::Tensor want = grad.to(at::kDouble) * Map(x, GeluGradDouble);
  GeluBackwardOut(grad, grad, x);
  EXPECT_LT(MaxAbsError(grad, want), 1e-5);
}

// A value's result does not depend on where it sits (a lane, the padded
// tail, a thread's share), so it is the same alone and in a large tensor,
// whatever the thread count.
TEST(GeluTest, AValueIsTheSameAloneAndInABatch) {
  at::manual_seed(4);
  const at::Tensor x = at::randn({100003});
  const int threads = at::get_num_threads();
  at::Tensor one_thread = at::empty_like(x), two_threads = at::empty_like(x);
  at::set_num_threads(1);
  GeluOut(one_thread, x);
  at::set_num_threads(2);
  GeluOut(two_threads, x);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(one_thread, two_threads));
  for (const int64_t i : {0, 1, 50000, 100002}) {
    at::Tensor alone = at::empty({1});
    GeluOut(alone, x.narrow(0, i, 1).contiguous());
    EXPECT_EQ(alone.item<float>(), one_thread[i].item<float>()) << "value " << i;
  }
}

TEST(GeluTest, NonFiniteInputsPropagate) {
  const float inf = std::numeric_limits<float>::infinity();
  const at::Tensor x = at::tensor({std::nanf(""), inf, -inf, 0.0f});
  at::Tensor y = at::empty_like(x);
  GeluOut(y, x);
  EXPECT_TRUE(std::isnan(y[0].item<float>()));
  EXPECT_EQ(y[1].item<float>(), inf);
  EXPECT_EQ(y[3].item<float>(), 0.0f);
  at::Tensor g = at::empty_like(x);
  GeluBackwardOut(g, at::ones_like(x), x);
  EXPECT_TRUE(std::isnan(g[0].item<float>()));
  EXPECT_EQ(g[3].item<float>(), 0.5f);
}

// Other tensors (non-contiguous, double) take LibTorch's GELU.
TEST(GeluTest, OtherTensorsTakeLibTorchsGelu) {
  at::manual_seed(5);
  const at::Tensor wide = at::randn({300, 40});
  const at::Tensor strided = wide.t();
  at::Tensor y = at::empty(strided.sizes()), want = at::empty(strided.sizes());
  GeluOut(y, strided);
  at::gelu_out(want, strided);
  EXPECT_TRUE(at::equal(y, want));
  const at::Tensor d = at::randn({300, 8}, at::kDouble);
  at::Tensor yd = at::empty_like(d);
  GeluOut(yd, d);
  EXPECT_TRUE(at::equal(yd, at::gelu(d)));
  at::Tensor gd = at::empty_like(d);
  const at::Tensor grad = at::randn({300, 8}, at::kDouble);
  GeluBackwardOut(gd, grad, d);
  EXPECT_TRUE(at::equal(gd, at::gelu_backward(grad, d)));
}

}  // namespace
}  // namespace himoe
