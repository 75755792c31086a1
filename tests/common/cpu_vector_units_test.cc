#include "common/cpu_vector_units.h"

#include <fstream>
#include <sstream>

#include "gtest/gtest.h"

namespace himoe {
namespace {

// The peak scales with the threads. (On the clock /proc/cpuinfo reports at
// one moment: the clock itself may change between two reads.)
TEST(CpuVectorUnitsTest, VectorPeakScalesWithThreads) {
  ASSERT_GT(VectorPeakGflops(1), 0) << "no 'cpu MHz' in /proc/cpuinfo";
  std::ifstream cpuinfo("/proc/cpuinfo");
  const double mhz = MaxCpuMhz(cpuinfo);
  ASSERT_GT(mhz, 0) << "no 'cpu MHz' in /proc/cpuinfo";
  const double one = VectorPeakGflopsAt(1, mhz, Fp32VectorLanes());
  EXPECT_DOUBLE_EQ(VectorPeakGflopsAt(3, mhz, Fp32VectorLanes()), 3 * one);
}

// threads x GHz x lanes x 2 (FMA) x 2 (FMA units); no clock, no peak.
TEST(CpuVectorUnitsTest, ThePeakIsTheClockTimesTheLanes) {
  EXPECT_DOUBLE_EQ(VectorPeakGflopsAt(2, 2500, 16), 2 * 2.5 * 16 * 4);
  EXPECT_DOUBLE_EQ(VectorPeakGflopsAt(1, 3000, 8), 3.0 * 8 * 4);
  EXPECT_EQ(VectorPeakGflopsAt(4, 0, 16), 0);
}

TEST(CpuVectorUnitsTest, TheFastestClockIsRead) {
  std::istringstream cpuinfo(
      "processor\t: 0\ncpu MHz\t\t: 2600.000\nflags\t\t: fpu avx\n\n"
      "processor\t: 1\ncpu MHz\t\t: 3100.5\n\nprocessor\t: 2\ncpu MHz\t\t: oops\n");
  EXPECT_DOUBLE_EQ(MaxCpuMhz(cpuinfo), 3100.5);
  std::istringstream none("processor\t: 0\nflags\t\t: fpu\n");
  EXPECT_EQ(MaxCpuMhz(none), 0);
}

// The lanes follow the flags, and the families nest.
TEST(CpuVectorUnitsTest, TheLanesFollowTheFlags) {
  EXPECT_EQ(Fp32VectorLanes(), CpuHas("avx512") ? 16 : CpuHas("avx") ? 8 : 4);
  EXPECT_TRUE(!CpuHas("avx512") || CpuHas("avx2"));
  EXPECT_TRUE(!CpuHas("avx2") || CpuHas("avx"));
  __builtin_cpu_init();
  EXPECT_EQ(CpuHas("avx2"), __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
}

}  // namespace
}  // namespace himoe
