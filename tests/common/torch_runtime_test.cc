#include "common/torch_runtime.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <stdexcept>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace himoe {
namespace {

using ::testing::HasSubstr;

TEST(TorchRuntimeTest, ConfigureTorchThreadsSetsTheIntraOpCount) {
  ASSERT_TRUE(ConfigureTorchThreads(2).ok());
  EXPECT_EQ(at::get_num_threads(), 2);
}

TEST(TorchRuntimeTest, BlisThreadsFollowTheCount) {
  // ctest starts each test in its own process, so BLIS is not initialized yet.
  unsetenv("BLIS_NUM_THREADS");
  ASSERT_TRUE(ConfigureTorchThreads(2).ok());
  ASSERT_NE(getenv("BLIS_NUM_THREADS"), nullptr);
  EXPECT_STREQ(getenv("BLIS_NUM_THREADS"), "2");
  // An explicit count overrides an inherited value (a child started with
  // --threads 1 by a parent that set 2)...
  ASSERT_TRUE(ConfigureTorchThreads(1).ok());
  EXPECT_STREQ(getenv("BLIS_NUM_THREADS"), "1");
  // ... "all cores" keeps what the environment says.
  setenv("BLIS_NUM_THREADS", "3", 1);
  ASSERT_TRUE(ConfigureTorchThreads(0).ok());
  EXPECT_STREQ(getenv("BLIS_NUM_THREADS"), "3");
}

TEST(TorchRuntimeTest, ZeroThreadsMeansAllAvailableCores) {
  ASSERT_GE(DefaultThreadCount(), 1);
  ASSERT_TRUE(ConfigureTorchThreads(0).ok());
  EXPECT_EQ(at::get_num_threads(), DefaultThreadCount());
}

TEST(TorchRuntimeTest, ParsesCpu) {
  const absl::StatusOr<c10::Device> device = ParseDevice("cpu");
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ(device->type(), c10::kCPU);
}

TEST(TorchRuntimeTest, RejectsUnknownDevice) {
  const absl::StatusOr<c10::Device> device = ParseDevice("bogus");
  EXPECT_EQ(device.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(device.status().message(), HasSubstr("'bogus'"));
}

TEST(TorchRuntimeTest, CudaDependsOnTheBuild) {
  const absl::StatusOr<c10::Device> device = ParseDevice("cuda:0");
  if (torch::cuda::is_available()) {
    ASSERT_TRUE(device.ok()) << device.status();
    EXPECT_TRUE(device->is_cuda());
    EXPECT_EQ(device->index(), 0);
  } else {
    EXPECT_FALSE(device.ok());
    EXPECT_THAT(device.status().message(), HasSubstr("cuda:0"));
  }
}

TEST(TorchRuntimeTest, CatchTorchErrorsConvertsExceptions) {
  const absl::Status torch_error = CatchTorchErrors([]() -> absl::Status {
    (void)at::mm(at::ones({2, 3}), at::ones({2, 3}));
    return absl::OkStatus();
  });
  EXPECT_EQ(torch_error.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(
      torch_error.message(),
      HasSubstr("torch error: mat1 and mat2 shapes cannot be multiplied"));

  const absl::Status std_error = CatchTorchErrors(
      []() -> absl::Status { throw std::runtime_error("boom"); });
  EXPECT_EQ(std_error.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std_error.message(), HasSubstr("boom"));

  EXPECT_TRUE(CatchTorchErrors([] { return absl::OkStatus(); }).ok());
}

}  // namespace
}  // namespace himoe
