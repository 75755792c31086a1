#ifndef HIMOE_ROUTER_SERVICE_BATCHER_H_
#define HIMOE_ROUTER_SERVICE_BATCHER_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace himoe::router {

// What one layer forward returns, row-aligned with its input.
struct LayerResult {
  at::Tensor output;      // [T, d] float
  at::Tensor expert_ids;  // [T, K] int64
  at::Tensor weights;     // [T, K] float
};

struct BatcherOptions {
  int64_t max_batch_tokens = 8192;
  // Batches computed at once (each its own worker thread): while one waits
  // for the groups, the next is routed, encoded and sent. Requests are
  // routed each as if alone, so this changes no output.
  int max_batches_in_flight = 2;
  // How long the first request of a batch waits for company (Triton's
  // max_queue_delay_microseconds). 0 = no waiting.
  std::chrono::microseconds max_queue_delay{500};
  // Requests that may wait in the queue (all layers); more get
  // RESOURCE_EXHAUSTED at once, naming `queue_limit_name`.
  int64_t max_queue_requests = 4096;
  std::string queue_limit_name = "max_queue_requests";
  // Called with (tokens, requests) of every batch, before it runs.
  std::function<void(int64_t, int64_t)> on_batch;
  // Called with the queue's depth whenever it changes (under the lock: keep
  // it cheap, e.g. a gauge).
  std::function<void(int64_t)> on_queue_depth;
};

// Dynamic batching: concurrent requests for the same layer are merged into
// one computation of at most max_batch_tokens rows, up to
// max_batches_in_flight computations at once; each caller gets exactly its
// own rows back.
class Batcher {
 public:
  using Deadline = std::chrono::system_clock::time_point;
  // `segments`: each merged request's row count, in order; `deadline`: the
  // latest of the batch's requests' deadlines.
  using Compute = std::function<absl::StatusOr<LayerResult>(
      int layer, const at::Tensor& x, const std::vector<int64_t>& segments, Deadline deadline)>;
  using Done = std::function<void(absl::StatusOr<LayerResult>)>;

  Batcher(const BatcherOptions& options, Compute compute);
  ~Batcher();  // finishes queued work, then stops

  // A request whose `deadline` passes while it is queued is not computed: its
  // `done` gets DEADLINE_EXCEEDED. A full queue calls `done` at once with
  // RESOURCE_EXHAUSTED.
  void Submit(int layer, at::Tensor x, Done done, Deadline deadline = Deadline::max());

  // Requests the caller has batched itself (Generate's decoding step: one per
  // stream), queued together so that one batch takes them all (within
  // max_batch_tokens). Their batch starts at once, with whatever of the layer
  // is queued, instead of waiting max_queue_delay for company: the caller
  // waits on every token. `dones[i]` answers `xs[i]`. A queue without room
  // for all of them answers all with RESOURCE_EXHAUSTED.
  void SubmitBatched(int layer, std::vector<at::Tensor> xs, std::vector<Done> dones,
                     Deadline deadline = Deadline::max());

  int64_t batches() const;  // computations run so far

 private:
  struct Item {
    int layer;
    at::Tensor x;
    Done done;
    std::chrono::steady_clock::time_point enqueued;
    Deadline deadline;
    bool start_now = false;  // from SubmitBatched: its batch does not wait
  };
  // Queues all of `items` under one lock and wakes the workers; or, when the
  // queue has no room for them all, queues none (`items` untouched) and
  // returns the depth it found.
  std::optional<int64_t> Enqueue(std::vector<Item>& items);
  // The workers' loop: waits for a layer's batch to fill (or its oldest
  // request's max_queue_delay), takes it and runs it.
  void Loop();
  // With mu_ held: removes the queued requests whose deadline passed.
  std::vector<Item> TakeLate();
  // Without mu_: answers them with DEADLINE_EXCEEDED.
  static void AnswerLate(std::vector<Item>& late);
  // With mu_ held: the tokens of `layer` queued so far, in arrival order,
  // within the budget; or the budget, when a request there must start now.
  int64_t ReadyTokens(int layer) const;
  // With mu_ held: removes and returns, in arrival order, every request of
  // `layer` that still fits the budget (the first one always).
  std::vector<Item> TakeBatch(int layer);
  void Run(std::vector<Item> batch);

  const BatcherOptions options_;
  const Compute compute_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  int64_t batches_ = 0;
  std::vector<std::thread> workers_;
};

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_BATCHER_H_
