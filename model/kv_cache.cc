#include "model/kv_cache.h"

#include <algorithm>
#include <functional>
#include <utility>

#include <ATen/ATen.h>

namespace himoe::model {

KvCache::KvCache(KvCache&& other) noexcept
    : length(other.length), pool_(other.pool_), slot_(other.slot_) {
  other.pool_ = nullptr;
  other.slot_ = -1;
  other.length = 0;
}

KvCache& KvCache::operator=(KvCache&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = other.pool_;
    slot_ = other.slot_;
    length = other.length;
    other.pool_ = nullptr;
    other.slot_ = -1;
    other.length = 0;
  }
  return *this;
}

KvCache::~KvCache() { Release(); }

void KvCache::Release() {
  if (pool_ != nullptr) pool_->Release(slot_);
  pool_ = nullptr;
  slot_ = -1;
  length = 0;
}

KvCachePool::KvCachePool(int num_blocks, int64_t max_rows, int64_t d_model)
    : max_rows_(max_rows), d_model_(d_model), k_(num_blocks), v_(num_blocks) {}

KvCache KvCachePool::Acquire() {
  KvCache cache;
  std::lock_guard<std::mutex> lock(mu_);
  cache.pool_ = this;
  if (free_.empty()) {
    cache.slot_ = next_slot_++;
  } else {
    // Lowest first keeps the slots in use dense, so the tensors stay small.
    std::pop_heap(free_.begin(), free_.end(), std::greater<int>());
    cache.slot_ = free_.back();
    free_.pop_back();
  }
  return cache;
}

void KvCachePool::Release(int slot) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(slot);
  std::push_heap(free_.begin(), free_.end(), std::greater<int>());
}

int KvCachePool::slots_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_slot_ - static_cast<int>(free_.size());
}

void KvCachePool::Reserve(int slots, int64_t rows, const c10::TensorOptions& options) {
  rows = std::min(rows, max_rows_);
  for (std::vector<at::Tensor>* kv : {&k_, &v_}) {
    for (at::Tensor& t : *kv) {
      const int64_t have_slots = t.defined() ? t.size(0) : 0;
      const int64_t have_rows = t.defined() ? t.size(1) : 0;
      if (have_slots >= slots && have_rows >= rows) continue;
      const int64_t new_slots = std::max<int64_t>(slots, have_slots < slots ? 2 * have_slots : have_slots);
      const int64_t new_rows =
          std::min(max_rows_, std::max<int64_t>(rows, have_rows < rows ? 2 * have_rows : have_rows));
      // Zero-filled: a gather reads rows past a sequence's length, which its
      // mask gives weight 0, and 0 times a stale finite value is 0.
      at::Tensor grown = at::zeros({new_slots, new_rows, d_model_}, options);
      if (t.defined()) grown.narrow(0, 0, have_slots).narrow(1, 0, have_rows).copy_(t);
      t = std::move(grown);
    }
  }
}

}  // namespace himoe::model
