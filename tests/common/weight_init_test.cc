// The released code's init: torch.nn.init.trunc_normal_'s distribution, from
// the normal's closed forms.
#include "common/weight_init.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "gtest/gtest.h"

namespace himoe {
namespace {

// A standard normal truncated to [-2, 2]: Z = 2 Phi(2) - 1, variance
// 1 - 4 phi(2) / Z, mass beyond +-1 is 2 (Phi(2) - Phi(1)) / Z.
double Phi(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }
double phi(double x) { return std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI); }

TEST(WeightInitTest, TruncatedNormalHasTheTruncatedMomentsAndBounds) {
  const double z = 2 * Phi(2) - 1;
  const double std_factor = std::sqrt(1 - 4 * phi(2) / z);  // 0.8796
  const double beyond_one = 2 * (Phi(2) - Phi(1)) / z;       // 0.2848
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  for (const double std : {0.5, 0.028}) {
    at::Tensor t = at::empty({400000});
    TruncatedNormal_(t, std, gen);
    EXPECT_LE(t.abs().max().item<double>(), 2 * std);
    EXPECT_GT(t.abs().max().item<double>(), 1.99 * std);  // the whole range is used
    EXPECT_NEAR(t.mean().item<double>(), 0.0, 0.005 * std);
    EXPECT_NEAR(t.std().item<double>(), std_factor * std, 0.005 * std);
    EXPECT_NEAR((t.abs() > std).to(at::kDouble).mean().item<double>(), beyond_one, 0.003);
  }
}

TEST(WeightInitTest, SwitchInitScalesWithFanIn) {
  const double z = 2 * Phi(2) - 1;
  const double std_factor = std::sqrt(1 - 4 * phi(2) / z);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(8);
  at::Tensor t = at::empty({512, 512});
  SwitchInit_(t, 128, gen);  // std sqrt(0.1 / 128) = 0.02795
  const double std = std::sqrt(0.1 / 128);
  EXPECT_LE(t.abs().max().item<double>(), 2 * std);
  EXPECT_NEAR(t.std().item<double>(), std_factor * std, 0.01 * std);
  EXPECT_DOUBLE_EQ(ResidualInitStd(4), 0.02 / std::sqrt(8.0));
}

}  // namespace
}  // namespace himoe
