#include "trainer/micro_batch_turns.h"

#include <algorithm>

namespace himoe::trainer {

MicroBatchTurns::MicroBatchTurns(int layers)
    : layers_(std::max(layers, 0)), next_(static_cast<size_t>(layers_) + 1, 0) {}

int MicroBatchTurns::Point(Turn turn, int layer) const {
  return turn == Turn::kRoute ? layer : layers_;
}

void MicroBatchTurns::Begin() {
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(next_.begin(), next_.end(), 0);
  finished_.clear();
  error_ = absl::OkStatus();
  active_ = true;
}

void MicroBatchTurns::End() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    active_ = false;
  }
  changed_.notify_all();
}

absl::Status MicroBatchTurns::Wait(Turn turn, int layer, uint32_t micro_batch) {
  const int point = Point(turn, layer);
  std::unique_lock<std::mutex> lock(mu_);
  while (error_.ok() && active_) {
    uint32_t& next = next_[point];
    if (next >= micro_batch) return absl::OkStatus();
    if (finished_.count(next) > 0) {
      ++next;
      continue;
    }
    changed_.wait(lock);
  }
  return active_ ? error_ : absl::OkStatus();
}

void MicroBatchTurns::Pass(Turn turn, int layer, uint32_t micro_batch) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    uint32_t& next = next_[Point(turn, layer)];
    next = std::max(next, micro_batch + 1);
  }
  changed_.notify_all();
}

void MicroBatchTurns::Finish(uint32_t micro_batch) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished_.insert(micro_batch);
  }
  changed_.notify_all();
}

void MicroBatchTurns::Cancel(const absl::Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.ok()) error_ = status.ok() ? absl::CancelledError("cancelled") : status;
  }
  changed_.notify_all();
}

}  // namespace himoe::trainer
