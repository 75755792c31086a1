#ifndef HIMOE_MODEL_KV_CACHE_H_
#define HIMOE_MODEL_KV_CACHE_H_

#include <cstdint>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

namespace himoe::model {

class KvCachePool;

// One sequence's place in a KvCachePool: the keys and values of its first
// `length` tokens. Move-only; gives its slot back when destroyed or reset.
class KvCache {
 public:
  KvCache() = default;
  KvCache(KvCache&& other) noexcept;
  KvCache& operator=(KvCache&& other) noexcept;
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;
  ~KvCache();

  KvCachePool* pool() const { return pool_; }
  int slot() const { return slot_; }

  int64_t length = 0;

 private:
  friend class KvCachePool;
  void Release();

  KvCachePool* pool_ = nullptr;
  int slot_ = -1;
};

// Keys and values of many sequences, a slot each (one block of rows per
// sequence, as a KV cache without paging): per transformer block, two
// tensors [slots, rows, d_model]. A decoding step writes every sequence's new
// keys with one scatter and reads them back with one gather, whatever the
// number of sequences. Slots are reused; the tensors grow (doubling) to the
// slots and rows in use, rows up to max_rows. Acquire and the release of a
// KvCache are thread-safe; the tensors are for one decoding thread.
class KvCachePool {
 public:
  KvCachePool(int num_blocks, int64_t max_rows, int64_t d_model);
  KvCachePool(const KvCachePool&) = delete;
  KvCachePool& operator=(const KvCachePool&) = delete;

  KvCache Acquire();

  // Grows the tensors (zero-filled) to hold slots [0, slots) and rows
  // [0, rows), keeping what they hold. rows <= max_rows.
  void Reserve(int slots, int64_t rows, const c10::TensorOptions& options);

  int64_t max_rows() const { return max_rows_; }
  int slots_in_use() const;
  at::Tensor& keys(size_t block) { return k_[block]; }
  at::Tensor& values(size_t block) { return v_[block]; }

 private:
  friend class KvCache;
  void Release(int slot);

  const int64_t max_rows_;
  const int64_t d_model_;
  std::vector<at::Tensor> k_, v_;  // per block [slot capacity, row capacity, d_model]
  mutable std::mutex mu_;
  std::vector<int> free_;  // released slots, reused lowest first
  int next_slot_ = 0;      // slots ever handed out
};

}  // namespace himoe::model

#endif  // HIMOE_MODEL_KV_CACHE_H_
