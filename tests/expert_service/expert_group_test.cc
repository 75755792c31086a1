#include "expert_service/expert_group.h"

#include <cmath>

#include <gtest/gtest.h>

namespace himoe::expert {
namespace {

ExpertGroupOptions Options(int group_id) {
  ExpertGroupOptions o;
  o.group_id = group_id;
  o.experts_per_group = 3;
  o.d_model = 8;
  o.d_ff = 12;
  o.layer = 2;
  o.seed = 42;
  return o;
}

TEST(ExpertGroupTest, WeightsDependOnlyOnSeedLayerAndExpert) {
  auto a = ExpertGroup::Create(Options(1));
  auto b = ExpertGroup::Create(Options(1));
  ExpertGroupOptions other_layer = Options(1);
  other_layer.layer = 3;
  auto c = ExpertGroup::Create(other_layer);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(at::equal((*a)->parameters()[i], (*b)->parameters()[i]));
    EXPECT_FALSE(at::equal((*a)->parameters()[i], (*c)->parameters()[i]));
  }
  // nn.Linear init bound 1/sqrt(fan_in).
  EXPECT_LE((*a)->parameters()[0].abs().max().item<double>(), 1 / std::sqrt(8.0));
  EXPECT_EQ((*a)->first_expert(), 3);
}

TEST(ExpertGroupTest, ForwardAppliesEachRowsOwnExpert) {
  auto group = ExpertGroup::Create(Options(1));
  ASSERT_TRUE(group.ok());
  const at::Tensor rows = at::randn({7, 8});
  const at::Tensor ids = at::tensor({5, 3, 4, 5, 3, 3, 5}, at::kLong);
  auto out = (*group)->Forward(rows, ids);
  ASSERT_TRUE(out.ok()) << out.status();
  const auto p = (*group)->parameters();
  for (int64_t r = 0; r < 7; ++r) {
    const int64_t e = ids[r].item<int64_t>() - 3;
    const at::Tensor h = at::mv(p[0][e], rows[r]) + p[1][e];
    const at::Tensor gelu = 0.5 * h * (1 + at::erf(h / std::sqrt(2.0)));
    const at::Tensor want = at::mv(p[2][e], gelu) + p[3][e];
    EXPECT_TRUE(at::allclose((*out)[r], want, 1e-5, 1e-6)) << "row " << r;
  }
}

TEST(ExpertGroupTest, RejectsExpertOutsideGroupAndWrongWidth) {
  auto group = ExpertGroup::Create(Options(1));
  ASSERT_TRUE(group.ok());
  auto outside = (*group)->Forward(at::randn({2, 8}), at::tensor({3, 6}, at::kLong));
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(outside.status().message().find("must be in [3, 6)"), std::string::npos);
  auto width = (*group)->Forward(at::randn({2, 9}), at::tensor({3, 4}, at::kLong));
  EXPECT_EQ(width.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(width.status().message().find("d_model=8"), std::string::npos);
  ExpertGroupOptions bad = Options(0);
  bad.dtype = at::kDouble;
  EXPECT_EQ(ExpertGroup::Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ExpertGroupTest, Bf16GroupComputesInBf16) {
  ExpertGroupOptions o = Options(0);
  o.dtype = at::kBFloat16;
  auto group = ExpertGroup::Create(o);
  ASSERT_TRUE(group.ok());
  auto out = (*group)->Forward(at::randn({4, 8}), at::tensor({0, 1, 2, 0}, at::kLong));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->scalar_type(), at::kBFloat16);
}

TEST(ExpertGroupTest, CudaDeviceWhenAvailable) {
  if (!at::hasCUDA()) GTEST_SKIP() << "LibTorch has no CUDA on this machine";
  ExpertGroupOptions o = Options(0);
  o.device = c10::Device("cuda:0");
  auto cpu = ExpertGroup::Create(Options(0));
  auto gpu = ExpertGroup::Create(o);
  ASSERT_TRUE(cpu.ok() && gpu.ok());
  const at::Tensor rows = at::randn({5, 8});
  const at::Tensor ids = at::tensor({0, 1, 2, 1, 0}, at::kLong);
  auto a = (*cpu)->Forward(rows, ids);
  auto b = (*gpu)->Forward(rows, ids);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(at::allclose(*a, b->cpu(), 1e-4, 1e-5));
}

}  // namespace
}  // namespace himoe::expert
