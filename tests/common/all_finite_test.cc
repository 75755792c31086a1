#include "common/all_finite.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

#include "gtest/gtest.h"

namespace himoe {
namespace {

// Against at::isfinite(t).all(): one NaN, +Inf or -Inf at the first, a
// middle and the last place (inside and past the 256-element blocks), in
// every floating dtype, contiguous or not.
TEST(AllFiniteTest, MatchesIsfiniteForEveryFloatingTypeAndPlace) {
  at::manual_seed(3);
  const float kBad[] = {std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity()};
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    for (const int64_t n : {int64_t{1}, int64_t{255}, int64_t{256}, int64_t{257}, int64_t{1000}}) {
      const at::Tensor clean = at::randn({n}).mul(100).to(dtype);
      EXPECT_TRUE(AllFinite(clean)) << c10::toString(dtype) << " " << n;
      for (const float bad : kBad) {
        for (const int64_t at : {int64_t{0}, n / 2, n - 1}) {
          at::Tensor t = clean.clone();
          t[at] = bad;
          ASSERT_FALSE(at::isfinite(t).all().item<bool>());
          EXPECT_FALSE(AllFinite(t)) << c10::toString(dtype) << " " << n << " at " << at
                                     << " value " << bad;
        }
      }
    }
  }
  // The largest finite values and the smallest subnormals are finite.
  EXPECT_TRUE(AllFinite(at::tensor({std::numeric_limits<float>::max(),
                                       -std::numeric_limits<float>::max(),
                                       std::numeric_limits<float>::denorm_min(), 0.0f, -0.0f})));
  EXPECT_TRUE(AllFinite(at::tensor({65504.0f, -65504.0f}).to(at::kHalf)));
}

TEST(AllFiniteTest, ViewsEmptyAndIntegerTensors) {
  at::Tensor m = at::randn({64, 48});
  m[5][40] = std::numeric_limits<float>::quiet_NaN();
  // A transposed view and a slice that leaves the NaN out.
  EXPECT_FALSE(AllFinite(m.t()));
  EXPECT_TRUE(AllFinite(m.narrow(0, 6, 58).t()));
  EXPECT_TRUE(AllFinite(m.narrow(1, 0, 40)));
  EXPECT_TRUE(AllFinite(at::empty({0, 256})));
  EXPECT_TRUE(AllFinite(at::arange(10)));  // int64: always finite, as at::isfinite
  // A leaf that requires grad is read without a graph.
  EXPECT_TRUE(AllFinite(at::ones({3}).requires_grad_()));
}

}  // namespace
}  // namespace himoe
