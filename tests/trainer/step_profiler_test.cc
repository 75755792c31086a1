#include "trainer/step_profiler.h"

#include <map>
#include <string>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "common/profile_scope.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace himoe::trainer {
namespace {

std::map<std::string, StepProfiler::Row> ByCategory(const StepProfiler& p) {
  std::map<std::string, StepProfiler::Row> rows;
  for (const StepProfiler::Row& r : p.Rows()) rows[r.category] = r;
  return rows;
}

// y = sum((x @ w)^2) with the product in scope "alpha" and the square in
// "beta"; backward outside every scope.
at::Tensor TwoScopes(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor h;
  {
    HIMOE_PROFILE_SCOPE("alpha");
    h = at::mm(x, w);
  }
  HIMOE_PROFILE_SCOPE("beta");
  return h.pow(2).sum();
}

TEST(StepProfilerTest, BackwardTimeGoesToTheScopeOfItsForward) {
  auto profiler = StepProfiler::Start();
  ASSERT_TRUE(profiler.ok()) << profiler.status();
  const at::Tensor x = at::randn({256, 256});
  const at::Tensor w = at::randn({256, 256}).requires_grad_(true);
  (*profiler)->BeginStep();
  TwoScopes(x, w).backward();
  (*profiler)->EndStep();
  const auto rows = ByCategory(**profiler);
  ASSERT_TRUE(rows.count("alpha"));
  ASSERT_TRUE(rows.count("beta"));
  // MmBackward runs for alpha; PowBackward and SumBackward for beta.
  EXPECT_GT(rows.at("alpha").forward_seconds, 0);
  EXPECT_GT(rows.at("alpha").backward_seconds, 0);
  EXPECT_GT(rows.at("beta").backward_seconds, 0);
  EXPECT_THAT((*profiler)->Table(1), ::testing::HasSubstr("| alpha | "));
}

TEST(StepProfilerTest, TimeOutsideStepsIsNotCharged) {
  auto profiler = StepProfiler::Start();
  ASSERT_TRUE(profiler.ok()) << profiler.status();
  {
    at::NoGradGuard no_grad;
    HIMOE_PROFILE_SCOPE("evaluation");
    at::mm(at::randn({128, 128}), at::randn({128, 128}));
  }
  (*profiler)->BeginStep();
  {
    HIMOE_PROFILE_SCOPE("gamma");
    at::mm(at::randn({128, 128}), at::randn({128, 128}));
  }
  (*profiler)->EndStep();
  const auto rows = ByCategory(**profiler);
  EXPECT_FALSE(rows.count("evaluation"));
  ASSERT_TRUE(rows.count("gamma"));
  EXPECT_EQ(rows.at("gamma").backward_seconds, 0);
}

TEST(StepProfilerTest, OnlyOneAtATime) {
  auto first = StepProfiler::Start();
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(StepProfiler::Start().status().code(), absl::StatusCode::kFailedPrecondition);
  first->reset();
  EXPECT_TRUE(StepProfiler::Start().ok());
}

}  // namespace
}  // namespace himoe::trainer
