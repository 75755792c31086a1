#ifndef HIMOE_EXPERT_SERVICE_SHARED_REGIONS_H_
#define HIMOE_EXPERT_SERVICE_SHARED_REGIONS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "common/shared_memory.h"

namespace himoe::expert {

// The bytes a call's request and answer take in a region: each run of
// `run_rows` rows at an aligned offset, the answer after the request.
uint64_t SharedBytesFor(const std::vector<int64_t>& run_rows, int64_t row_bytes);

// The lengths of the runs of equal ids in experts[begin, end).
std::vector<int64_t> RunLengths(const std::vector<int64_t>& experts, size_t begin, size_t end);

class SharedRegionPool;

// A region leased for one call; back to its pool when this goes, and dropped
// there unless Succeeded() (a late answer of a failed call may still write
// it). Empty: the call sends its bytes in the messages.
class RegionLease {
 public:
  RegionLease() = default;
  RegionLease(RegionLease&& other) noexcept { *this = std::move(other); }
  RegionLease& operator=(RegionLease&& other) noexcept;
  RegionLease(const RegionLease&) = delete;
  RegionLease& operator=(const RegionLease&) = delete;
  ~RegionLease() { Release(); }

  const std::shared_ptr<SharedMemoryRegion>& region() const { return region_; }
  void Succeeded() { ok_ = true; }

 private:
  friend class SharedRegionPool;
  RegionLease(SharedRegionPool* pool, int group, std::shared_ptr<SharedMemoryRegion> region)
      : pool_(pool), group_(group), region_(std::move(region)) {}
  void Release();

  SharedRegionPool* pool_ = nullptr;
  int group_ = 0;
  std::shared_ptr<SharedMemoryRegion> region_;
  bool ok_ = false;
};

// Each group's shared-memory regions, reused by one call after another. Calls
// in flight at once lease one each, up to `max_per_group` a group; past that
// a call gets an empty lease. Thread-safe; outlives its leases.
class SharedRegionPool {
 public:
  // Removes the regions that ended processes left in /dev/shm first (logged).
  SharedRegionPool(int num_groups, size_t max_per_group);

  // A region of `group` with room for `bytes` (made or grown here), or an
  // empty lease: every region of the group is leased, or none can be made
  // even after removing what ended processes left (then the pool leases
  // nothing from now on, and says so in the log).
  RegionLease Lease(int group, uint64_t bytes);

  // Regions the group holds now, leased or not.
  size_t regions(int group) const;

 private:
  friend class RegionLease;
  struct Slot {
    std::shared_ptr<SharedMemoryRegion> region;
    bool leased = false;
  };
  void Return(int group, const SharedMemoryRegion* region, bool ok);

  const size_t max_per_group_;
  mutable std::mutex mu_;
  std::vector<std::vector<Slot>> groups_;  // guarded by mu_
  bool failed_ = false;                    // guarded by mu_
};

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_SHARED_REGIONS_H_
