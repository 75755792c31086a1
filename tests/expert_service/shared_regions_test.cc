// SharedRegionPool: leases, reuse, growth, the per-group bound, and a failed
// call's region dropped, what ended processes left removed when a pool is
// made; the byte count and run lengths a call leases for.
#include "expert_service/shared_regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace himoe::expert {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

constexpr uint64_t kMiB = 1 << 20;

TEST(SharedRegionsTest, RunLengthsOfARange) {
  const std::vector<int64_t> experts = {3, 3, 3, 5, 5, 6, 7, 7};
  EXPECT_THAT(RunLengths(experts, 0, experts.size()), ElementsAre(3, 2, 1, 2));
  EXPECT_THAT(RunLengths(experts, 1, 4), ElementsAre(2, 1));
  EXPECT_THAT(RunLengths(experts, 5, 6), ElementsAre(1));
  EXPECT_THAT(RunLengths(experts, 4, 4), IsEmpty());
}

TEST(SharedRegionsTest, BytesForARequestAndItsAnswer) {
  // Runs of 3 and 1 rows of 40 bytes: 120 -> 128, then 128 + 40 = 168 -> 192;
  // the answer takes as much again.
  EXPECT_EQ(SharedBytesFor({3, 1}, 40), 2u * 192);
  EXPECT_EQ(SharedBytesFor({}, 40), 0u);
}

TEST(SharedRegionsTest, ASucceededLeaseIsReusedAFailedOneDropped) {
  SharedRegionPool pool(/*num_groups=*/2, /*max_per_group=*/4);
  std::string first;
  {
    RegionLease lease = pool.Lease(1, 1000);
    ASSERT_NE(lease.region(), nullptr);
    EXPECT_EQ(lease.region()->size(), kMiB);  // whole MiB
    first = lease.region()->name();
    lease.Succeeded();
  }
  EXPECT_EQ(pool.regions(1), 1u);
  EXPECT_EQ(pool.regions(0), 0u);
  {
    RegionLease again = pool.Lease(1, 5000);
    ASSERT_NE(again.region(), nullptr);
    EXPECT_EQ(again.region()->name(), first);  // the same region, free again
    // Not succeeded: a late answer may still write it, so it is dropped.
  }
  EXPECT_EQ(pool.regions(1), 0u);
  RegionLease fresh = pool.Lease(1, 5000);
  ASSERT_NE(fresh.region(), nullptr);
  EXPECT_NE(fresh.region()->name(), first);
}

TEST(SharedRegionsTest, AtMostMaxPerGroupAtOnceThenInline) {
  SharedRegionPool pool(/*num_groups=*/1, /*max_per_group=*/2);
  RegionLease a = pool.Lease(0, 100);
  RegionLease b = pool.Lease(0, 100);
  ASSERT_NE(a.region(), nullptr);
  ASSERT_NE(b.region(), nullptr);
  EXPECT_NE(a.region()->name(), b.region()->name());
  const RegionLease c = pool.Lease(0, 100);
  EXPECT_EQ(c.region(), nullptr);  // all leased: the call goes inline
  a.Succeeded();
  a = RegionLease();  // returned
  const RegionLease d = pool.Lease(0, 100);
  EXPECT_NE(d.region(), nullptr);
  EXPECT_EQ(pool.regions(0), 2u);
  EXPECT_EQ(pool.Lease(7, 100).region(), nullptr);  // no such group
}

TEST(SharedRegionsTest, AGrowingCallGetsTwiceTheLastSize) {
  SharedRegionPool pool(/*num_groups=*/1, /*max_per_group=*/1);
  std::string small;
  {
    RegionLease lease = pool.Lease(0, kMiB);
    ASSERT_NE(lease.region(), nullptr);
    small = lease.region()->name();
    lease.Succeeded();
  }
  RegionLease lease = pool.Lease(0, kMiB + 1);
  ASSERT_NE(lease.region(), nullptr);
  EXPECT_NE(lease.region()->name(), small);
  EXPECT_EQ(lease.region()->size(), 2 * kMiB);
  EXPECT_EQ(pool.regions(0), 1u);
}

TEST(SharedRegionsTest, AMovedLeaseReturnsOnce) {
  SharedRegionPool pool(/*num_groups=*/1, /*max_per_group=*/1);
  {
    RegionLease a = pool.Lease(0, 100);
    a.Succeeded();
    RegionLease b = std::move(a);
    EXPECT_EQ(a.region(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from is empty
    ASSERT_NE(b.region(), nullptr);
  }
  EXPECT_EQ(pool.regions(0), 1u);
  EXPECT_NE(pool.Lease(0, 100).region(), nullptr);  // free again, not leased twice
}

// An object with a size that no creator holds (what a killed router leaves)
// is gone once a pool is made, before the pool's first lease.
TEST(SharedRegionsTest, APoolRemovesWhatEndedProcessesLeft) {
  const std::string name = absl::StrCat("/himoe-", getpid(), "-left-by-a-dead-router");
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 1 << 16), 0);
  close(fd);
  const std::string path = "/dev/shm" + name;
  ASSERT_EQ(access(path.c_str(), F_OK), 0);
  SharedRegionPool pool(/*num_groups=*/1, /*max_per_group=*/1);
  EXPECT_NE(access(path.c_str(), F_OK), 0);
  shm_unlink(name.c_str());
}

}  // namespace
}  // namespace himoe::expert
