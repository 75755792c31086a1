#include "common/process_stats.h"

#include <unistd.h>

#include <cstring>
#include <memory>

#include "gtest/gtest.h"

namespace himoe {
namespace {

TEST(ProcessStatsTest, PeakRssGrowsByTheBytesTouched) {
  const absl::StatusOr<int64_t> before = PeakRssBytes();
  ASSERT_TRUE(before.ok()) << before.status();
  constexpr int64_t kBytes = 64 << 20;
  std::unique_ptr<char[]> block(new char[kBytes]);
  std::memset(block.get(), 1, kBytes);  // resident only once written
  const absl::StatusOr<int64_t> after = PeakRssBytes(::getpid());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_GE(*after - *before, kBytes - (4 << 20));
  EXPECT_EQ(block[kBytes - 1], 1);
}

TEST(ProcessStatsTest, AMissingProcessIsNotFound) {
  // Above the largest pid Linux hands out (2^22).
  EXPECT_EQ(PeakRssBytes(1 << 23).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace himoe
