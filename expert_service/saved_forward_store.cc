#include "expert_service/saved_forward_store.h"

#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"

namespace himoe::expert {
namespace {

absl::Status AlreadySaved(const SavedKey& key) {
  return absl::AlreadyExistsError(absl::StrCat(
      "save_for_backward: a saved Forward ", key.DebugString(),
      " exists already; each key is used once per step"));
}

}  // namespace

bool SavedKey::operator<(const SavedKey& o) const {
  return std::tie(step, micro_batch, layer, request_id) <
         std::tie(o.step, o.micro_batch, o.layer, o.request_id);
}

std::string SavedKey::DebugString() const {
  return absl::StrCat("(step=", step, ", micro_batch=", micro_batch, ", layer=", layer,
                      ", request_id=", request_id, ")");
}

absl::Status SavedForwardStore::CheckUnused(const SavedKey& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return saved_.count(key) > 0 ? AlreadySaved(key) : absl::OkStatus();
}

absl::Status SavedForwardStore::Insert(const SavedKey& key, SavedForward saved) {
  saved.created = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  if (!saved_.emplace(key, std::move(saved)).second) return AlreadySaved(key);
  return absl::OkStatus();
}

absl::StatusOr<SavedForward> SavedForwardStore::Take(const SavedKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto node = saved_.extract(key);
  if (node.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "Backward: no saved Forward ", key.DebugString(),
        "; it was never saved with save_for_backward, already consumed, aborted or "
        "expired"));
  }
  return std::move(node.mapped());
}

int64_t SavedForwardStore::Abort(uint64_t step) {
  return DropIf([step](const SavedKey& key, const SavedForward&) {
    return step == 0 || key.step == step;
  });
}

void SavedForwardStore::SweepExpired() {
  const auto now = std::chrono::steady_clock::now();
  const int64_t expired = DropIf([&](const SavedKey&, const SavedForward& saved) {
    return now - saved.created >= ttl_;
  });
  expired_.fetch_add(expired, std::memory_order_relaxed);
}

int64_t SavedForwardStore::DropIf(
    const std::function<bool(const SavedKey&, const SavedForward&)>& drop) {
  std::vector<SavedForward> dropped;  // freed after the lock is released
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = saved_.begin(); it != saved_.end();) {
    if (drop(it->first, it->second)) {
      dropped.push_back(std::move(it->second));
      it = saved_.erase(it);
    } else {
      ++it;
    }
  }
  return static_cast<int64_t>(dropped.size());
}

int64_t SavedForwardStore::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(saved_.size());
}

}  // namespace himoe::expert
