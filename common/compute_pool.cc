#include "common/compute_pool.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace himoe {

absl::StatusOr<std::unique_ptr<ComputePool>> ComputePool::Create(
    const ComputePoolOptions& options) {
  if (options.workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("compute workers: ", options.workers, "; expected >= 1"));
  }
  if (options.max_queue < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.limit_name, ": ", options.max_queue, "; expected >= 0"));
  }
  std::unique_ptr<ComputePool> pool(new ComputePool(options));
  for (int i = 0; i < options.workers; ++i) {
    pool->workers_.emplace_back([p = pool.get()] { p->Loop(); });
  }
  return pool;
}

ComputePool::~ComputePool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

absl::Status ComputePool::Submit(std::function<void()> work) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Beyond the idle workers, at most max_queue pieces of work wait.
    const int64_t waiting = static_cast<int64_t>(queue_.size()) + running_ - options_.workers;
    if (stopping_ || waiting >= options_.max_queue) {
      ++rejected_;
      return absl::ResourceExhaustedError(absl::StrCat(
          stopping_ ? "shutting down" : "compute queue full",
          ": ", std::max<int64_t>(waiting, 0), " requests waiting for ", options_.workers,
          " busy worker(s) (", options_.limit_name, " = ", options_.max_queue,
          "); retry later"));
    }
    queue_.push_back(std::move(work));
  }
  cv_.notify_one();
  return absl::OkStatus();
}

void ComputePool::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and everything ran
    std::function<void()> work = std::move(queue_.front());
    queue_.pop_front();
    ++running_;
    lock.unlock();
    work();
    work = nullptr;  // destroys captures before the counters move
    lock.lock();
    --running_;
    ++completed_;
  }
}

int64_t ComputePool::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(queue_.size());
}
int64_t ComputePool::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}
int64_t ComputePool::rejected() const {
  std::lock_guard<std::mutex> lock(mu_);
  return rejected_;
}
int64_t ComputePool::completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_;
}

}  // namespace himoe
