// A product through the BLAS in use, checked against sums in double.
#ifndef HIMOE_TESTS_COMMON_HAND_MATMUL_H_
#define HIMOE_TESTS_COMMON_HAND_MATMUL_H_

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "gtest/gtest.h"

namespace himoe::test_util {

// c = a @ b on seeded inputs, checked entry by entry against double sums.
inline void ExpectMatmulMatchesHandSums() {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor a = at::randn({96, 64}, gen);
  const at::Tensor b = at::randn({64, 80}, gen);
  const at::Tensor c = at::mm(a, b);
  const auto ac = a.accessor<float, 2>();
  const auto bc = b.accessor<float, 2>();
  const auto cc = c.accessor<float, 2>();
  double worst = 0;
  for (int i = 0; i < 96; ++i) {
    for (int j = 0; j < 80; ++j) {
      double sum = 0;
      for (int k = 0; k < 64; ++k) sum += static_cast<double>(ac[i][k]) * bc[k][j];
      worst = std::max(worst, std::abs(sum - cc[i][j]));
    }
  }
  EXPECT_LT(worst, 1e-3);
}

}  // namespace himoe::test_util

#endif  // HIMOE_TESTS_COMMON_HAND_MATMUL_H_
