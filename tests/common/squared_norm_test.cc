#include "common/squared_norm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>

#include "gtest/gtest.h"

namespace himoe {
namespace {

// Against a long-double sum of the squares, at sizes around the block and
// the 8-wide unroll, on a non-contiguous view too.
TEST(SquaredNormTest, MatchesTheSumOfSquares) {
  at::manual_seed(5);
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{9}, kSquaredNormBlock - 1,
                          kSquaredNormBlock, 3 * kSquaredNormBlock + 5}) {
    const at::Tensor t = at::randn({n});
    long double want = 0;
    const float* x = t.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) want += static_cast<long double>(x[i]) * x[i];
    EXPECT_NEAR(SquaredNorm(t), static_cast<double>(want), 1e-12 * static_cast<double>(want) + 1e-300)
        << n << " elements";
  }
  // {3, 4} and {12} by hand: 9 + 16 + 144.
  EXPECT_EQ(SquaredNorm(at::tensor({3.0f, 4.0f, 12.0f})), 169.0);
  const at::Tensor m = at::randn({64, 48});
  const at::Tensor view = m.t();  // not contiguous
  EXPECT_NEAR(SquaredNorm(view), m.to(at::kDouble).square().sum().item<double>(),
              1e-12 * m.numel());
  // Double input takes the tensor path, same value.
  EXPECT_NEAR(SquaredNorm(m.to(at::kDouble)), SquaredNorm(m), 1e-9);
}

// The block sums add in order whatever the thread count.
TEST(SquaredNormTest, SameBitsOnOneAndTwoThreads) {
  at::manual_seed(6);
  const at::Tensor t = at::randn({5 * kSquaredNormBlock + 123});
  const int saved = at::get_num_threads();
  at::set_num_threads(1);
  const double one = SquaredNorm(t);
  at::set_num_threads(2);
  const double two = SquaredNorm(t);
  at::set_num_threads(saved);
  EXPECT_EQ(one, two);
}

}  // namespace
}  // namespace himoe
