#ifndef HIMOE_COMMON_COMPUTE_POOL_H_
#define HIMOE_COMMON_COMPUTE_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace himoe {

struct ComputePoolOptions {
  int workers = 1;      // threads running work; each may use the torch threads
  int max_queue = 256;  // work waiting for a worker; more is refused
  std::string limit_name = "max_queue";  // the setting errors name, e.g. a flag
};

// Where the services compute, off gRPC's callback threads: a fixed set of
// workers and a bounded FIFO queue. Submit never blocks; a full queue is
// RESOURCE_EXHAUSTED naming the limit (Triton's max_queue_size).
class ComputePool {
 public:
  static absl::StatusOr<std::unique_ptr<ComputePool>> Create(const ComputePoolOptions& options);
  ~ComputePool();  // runs what is queued, then joins the workers

  absl::Status Submit(std::function<void()> work);

  int64_t queued() const;     // waiting for a worker
  int64_t running() const;    // on a worker now
  int64_t rejected() const;   // refused so far (queue full)
  int64_t completed() const;  // run so far
  const ComputePoolOptions& options() const { return options_; }

 private:
  explicit ComputePool(const ComputePoolOptions& options) : options_(options) {}
  void Loop();

  const ComputePoolOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  int64_t running_ = 0, rejected_ = 0, completed_ = 0;
  std::vector<std::thread> workers_;
};

}  // namespace himoe

#endif  // HIMOE_COMMON_COMPUTE_POOL_H_
