#include "common/gemm_rate.h"

#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/probe_process.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace himoe {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// The reference: exact on small integers, and a wrong entry is seen by its
// size, inside the rows checked only.
TEST(GemmRateTest, TheReferenceFindsAWrongEntry) {
  const at::Tensor a = at::arange(12, at::kFloat).reshape({3, 4});
  const at::Tensor b = at::arange(8, at::kFloat).reshape({4, 2});
  at::Tensor c = at::mm(a, b);
  EXPECT_EQ(MaxGemmError(a, b, c, 3, 2), 0);
  c[1][1] += 2.5f;
  EXPECT_DOUBLE_EQ(MaxGemmError(a, b, c, 3, 2), 2.5);
  EXPECT_EQ(MaxGemmError(a, b, c, 1, 2), 0);
}

// The probe matrices come from their own generator: drawing them leaves the
// global one, which seeds the model, where it was.
TEST(GemmRateTest, ProbeMatricesLeaveTheGlobalGeneratorAlone) {
  at::manual_seed(5);
  const at::Tensor expected = at::randn({4});
  at::manual_seed(5);
  const at::Tensor probe = ProbeMatrix(8, 8);
  EXPECT_EQ(probe.sizes(), (at::IntArrayRef{8, 8}));
  EXPECT_TRUE(at::equal(at::randn({4}), expected));
}

// A probe checks its product and answers "OK <GFLOP/s>".
TEST(GemmRateTest, AProbeAnswersWithACheckedRate) {
  const std::string answer = RunGemmProbe(1, 64, 32, 48, 0.001);
  ASSERT_THAT(answer, StartsWith("OK ")) << answer;
  std::string error;
  EXPECT_GT(ParseProbeAnswer(answer, &error), 0);
  EXPECT_EQ(error, "");
  EXPECT_GT(TimeGemm(ProbeMatrix(16, 16), ProbeMatrix(16, 16), 0.001), 0);
}

TEST(GemmRateTest, TheRateIsMeasuredHere) {
  at::set_num_threads(1);
  auto gflops = MeasureGemmRate(/*bf16=*/false);
  ASSERT_TRUE(gflops.ok()) << gflops.status();
  EXPECT_GT(*gflops, 0);
}

// Another thread count than this process's is measured in this program
// started again, which leaves this process's threads as they were.
TEST(GemmRateTest, TheRateOnOtherThreadsIsMeasuredInAFreshProcess) {
  at::set_num_threads(1);
  auto gflops = MeasureGemmRateInFreshProcess(2, 2, /*bf16=*/false);
  ASSERT_TRUE(gflops.ok()) << gflops.status();
  EXPECT_GT(*gflops, 0);
  EXPECT_EQ(at::get_num_threads(), 1);
}

}  // namespace
}  // namespace himoe
