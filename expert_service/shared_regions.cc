#include "expert_service/shared_regions.h"

#include <algorithm>
#include <string>
#include <utility>

#include <glog/logging.h>

#include "absl/strings/str_cat.h"

namespace himoe::expert {

uint64_t SharedBytesFor(const std::vector<int64_t>& run_rows, int64_t row_bytes) {
  uint64_t bytes = 0;
  for (const int64_t rows : run_rows) bytes = AlignSharedOffset(bytes + rows * row_bytes);
  return 2 * bytes;
}

std::vector<int64_t> RunLengths(const std::vector<int64_t>& experts, size_t begin, size_t end) {
  std::vector<int64_t> lengths;
  for (size_t i = begin + 1; i <= end; ++i) {
    if (i < end && experts[i] == experts[begin]) continue;
    lengths.push_back(static_cast<int64_t>(i - begin));
    begin = i;
  }
  return lengths;
}

RegionLease& RegionLease::operator=(RegionLease&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    group_ = other.group_;
    region_ = std::move(other.region_);
    ok_ = other.ok_;
  }
  return *this;
}

void RegionLease::Release() {
  if (pool_ != nullptr && region_ != nullptr) pool_->Return(group_, region_.get(), ok_);
  pool_ = nullptr;
  region_.reset();
}

namespace {

// Removes what ended processes left in /dev/shm; how many.
int RemoveOrphans() {
  const OrphanedSharedMemory removed = RemoveOrphanedSharedMemory();
  if (removed.regions > 0) {
    LOG(INFO) << "removed " << removed.regions << " shared-memory region(s) of "
              << removed.bytes / (1 << 20) << " MiB in all that processes which have ended "
              << "left in /dev/shm";
  }
  return removed.regions;
}

}  // namespace

SharedRegionPool::SharedRegionPool(int num_groups, size_t max_per_group)
    : max_per_group_(max_per_group < 1 ? 1 : max_per_group), groups_(num_groups) {
  RemoveOrphans();
}

RegionLease SharedRegionPool::Lease(int group, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_ || group < 0 || group >= static_cast<int>(groups_.size())) return RegionLease();
  std::vector<Slot>& slots = groups_[group];
  auto free = std::find_if(slots.begin(), slots.end(), [](const Slot& s) { return !s.leased; });
  if (free == slots.end() && slots.size() >= max_per_group_) return RegionLease();
  Slot* slot = free != slots.end() ? &*free : &slots.emplace_back();
  if (slot->region == nullptr || slot->region->size() < bytes) {
    // Whole MiB, and twice the last size, so a growing batch remaps rarely.
    constexpr uint64_t kMiB = 1 << 20;
    const uint64_t size = std::max<uint64_t>(
        (bytes + kMiB - 1) / kMiB * kMiB, slot->region == nullptr ? 0 : 2 * slot->region->size());
    slot->region.reset();
    const std::string tag = absl::StrCat("g", group);
    auto made = SharedMemoryRegion::Create(tag, size);
    // /dev/shm full of what a process killed since left: once more.
    if (!made.ok() && RemoveOrphans() > 0) made = SharedMemoryRegion::Create(tag, size);
    if (!made.ok()) {
      LOG(WARNING) << "expert group " << group << ": no shared memory (" << made.status()
                   << "); the rows go in the gRPC messages from now on";
      failed_ = true;
      slots.erase(slots.begin() + (slot - slots.data()));
      return RegionLease();
    }
    slot->region = std::move(*made);
  }
  slot->leased = true;
  return RegionLease(this, group, slot->region);
}

void SharedRegionPool::Return(int group, const SharedMemoryRegion* region, bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Slot>& slots = groups_[group];
  for (auto it = slots.begin(); it != slots.end(); ++it) {
    if (it->region.get() != region) continue;
    if (ok) {
      it->leased = false;
    } else {
      slots.erase(it);
    }
    return;
  }
}

size_t SharedRegionPool::regions(int group) const {
  std::lock_guard<std::mutex> lock(mu_);
  return groups_.at(group).size();
}

}  // namespace himoe::expert
