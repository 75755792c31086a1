#ifndef HIMOE_EXPERT_SERVICE_SAVED_FORWARD_STORE_H_
#define HIMOE_EXPERT_SERVICE_SAVED_FORWARD_STORE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace himoe::expert {

// (step, micro_batch, layer, request_id) of a saved Forward.
struct SavedKey {
  uint64_t step = 0;
  uint32_t micro_batch = 0;
  int32_t layer = 0;
  uint64_t request_id = 0;
  bool operator<(const SavedKey& o) const;
  std::string DebugString() const;
};

// A Forward kept for its Backward.
struct SavedForward {
  at::Tensor input;   // [rows, d] leaf in the group dtype, requires grad
  at::Tensor output;  // [rows, d] with its graph
  std::vector<int32_t> expert_ids;  // per request input
  std::vector<int64_t> rows;        // per request input
  // A Forward of TokenAssignments: their weights, a leaf requiring grad
  // (rows then holds the one count of distinct rows, expert_ids nothing).
  at::Tensor weights;
  uint64_t weights_version = 0;     // the service's weights version at Forward time
  std::chrono::steady_clock::time_point created;
};

// The saved Forwards of a service, by key, each used once. Thread-safe.
// Graphs that are dropped are freed outside the lock.
class SavedForwardStore {
 public:
  // States at least `ttl` old are dropped by SweepExpired.
  explicit SavedForwardStore(absl::Duration ttl) : ttl_(absl::ToChronoNanoseconds(ttl)) {}

  // ALREADY_EXISTS if `key` holds a saved Forward.
  absl::Status CheckUnused(const SavedKey& key) const;
  // Stamps `saved.created` and keeps it; ALREADY_EXISTS if the key is in use.
  absl::Status Insert(const SavedKey& key, SavedForward saved);
  // Removes and returns the saved Forward; NOT_FOUND if there is none.
  absl::StatusOr<SavedForward> Take(const SavedKey& key);
  // Drops the states of `step` (all of them when 0); returns how many.
  int64_t Abort(uint64_t step);
  // Drops the states at least ttl old and counts them in expired().
  void SweepExpired();

  int64_t size() const;
  int64_t expired() const { return expired_.load(std::memory_order_relaxed); }

 private:
  int64_t DropIf(const std::function<bool(const SavedKey&, const SavedForward&)>& drop);

  const std::chrono::nanoseconds ttl_;
  mutable std::mutex mutex_;
  std::map<SavedKey, SavedForward> saved_;  // guarded by mutex_
  std::atomic<int64_t> expired_{0};
};

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_SAVED_FORWARD_STORE_H_
