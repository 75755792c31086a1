#include "common/cpu_cores.h"

#include <sched.h>

#include <gtest/gtest.h>

namespace himoe {
namespace {

TEST(CpuCoresTest, CgroupCpuMaxGivesCoresRoundedUp) {
  EXPECT_EQ(CoresOfCpuMax("200000 100000"), 2);
  EXPECT_EQ(CoresOfCpuMax("150000 100000\n"), 2);  // 1.5 CPUs: 2 threads
  EXPECT_EQ(CoresOfCpuMax("50000 100000"), 1);
  EXPECT_EQ(CoresOfCpuMax("max 100000"), std::nullopt);  // no limit
  EXPECT_EQ(CoresOfCpuMax(""), std::nullopt);
  EXPECT_EQ(CoresOfCpuMax("-1 100000"), std::nullopt);
  EXPECT_EQ(CoresOfCpuMax("100000"), std::nullopt);
}

TEST(CpuCoresTest, DefaultIsTheAffinityMaskAtMostAndSharesSplitIt) {
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const int affinity = CPU_COUNT(&set);
  ASSERT_GE(DefaultThreadCount(), 1);
  EXPECT_LE(DefaultThreadCount(), affinity);
  // Narrowing the mask to one core narrows the default with it.
  // (DefaultThreadCount reads the mask on every call; the quota once.)
  cpu_set_t one;
  CPU_ZERO(&one);
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) {
      CPU_SET(c, &one);
      break;
    }
  }
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  EXPECT_EQ(DefaultThreadCount(), 1);
  EXPECT_EQ(ShareOfCores(5), 1);
  ASSERT_EQ(sched_setaffinity(0, sizeof(set), &set), 0);
  const int cores = DefaultThreadCount();
  EXPECT_EQ(ShareOfCores(1), cores);
  EXPECT_EQ(ShareOfCores(5), std::max(1, cores / 5));
  EXPECT_EQ(ShareOfCores(0), cores);
}

}  // namespace
}  // namespace himoe
