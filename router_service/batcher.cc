#include "router_service/batcher.h"

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/torch_runtime.h"

namespace himoe::router {

Batcher::Batcher(const BatcherOptions& options, Compute compute)
    : options_(options), compute_(std::move(compute)) {
  for (int i = 0; i < std::max(1, options.max_batches_in_flight); ++i) {
    workers_.emplace_back([this] { Loop(); });
  }
}

Batcher::~Batcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void Batcher::Submit(int layer, at::Tensor x, Done done, Deadline deadline) {
  std::vector<Item> items;
  items.push_back(
      {layer, std::move(x), std::move(done), std::chrono::steady_clock::now(), deadline});
  if (const std::optional<int64_t> depth = Enqueue(items)) {
    items[0].done(absl::ResourceExhaustedError(absl::StrCat(
        "router queue full: ", *depth, " requests waiting (", options_.queue_limit_name, " = ",
        options_.max_queue_requests, "); retry later")));
  }
}

void Batcher::SubmitBatched(int layer, std::vector<at::Tensor> xs, std::vector<Done> dones,
                            Deadline deadline) {
  std::vector<Item> items;
  const auto now = std::chrono::steady_clock::now();
  for (size_t i = 0; i < xs.size(); ++i) {
    items.push_back({layer, std::move(xs[i]), std::move(dones[i]), now, deadline,
                     /*start_now=*/true});
  }
  if (const std::optional<int64_t> depth = Enqueue(items)) {
    const absl::Status full = absl::ResourceExhaustedError(absl::StrCat(
        "router queue full: ", *depth, " requests waiting and ", items.size(), " more (",
        options_.queue_limit_name, " = ", options_.max_queue_requests, "); retry later"));
    for (Item& item : items) item.done(full);
  }
}

std::optional<int64_t> Batcher::Enqueue(std::vector<Item>& items) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t depth = static_cast<int64_t>(queue_.size());
    const int64_t n = static_cast<int64_t>(items.size());
    if (depth + n > options_.max_queue_requests) return depth;
    for (Item& item : items) queue_.push_back(std::move(item));
    if (options_.on_queue_depth) options_.on_queue_depth(depth + n);
  }
  cv_.notify_all();
  return std::nullopt;
}

int64_t Batcher::batches() const {
  std::lock_guard<std::mutex> lock(mu_);
  return batches_;
}

std::vector<Batcher::Item> Batcher::TakeLate() {
  std::vector<Item> late;
  const Deadline now = std::chrono::system_clock::now();
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (it->deadline > now) {
      ++it;
      continue;
    }
    late.push_back(std::move(*it));
    it = queue_.erase(it);
  }
  return late;
}

void Batcher::AnswerLate(std::vector<Item>& late) {
  for (Item& item : late) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - item.enqueued);
    item.done(absl::DeadlineExceededError(absl::StrCat(
        "the request's deadline passed after ", waited.count(),
        " ms in the batch queue, behind the batch in flight; not computed")));
  }
}

int64_t Batcher::ReadyTokens(int layer) const {
  int64_t tokens = 0;
  for (const Item& item : queue_) {
    if (item.layer != layer) continue;
    if (item.start_now) return options_.max_batch_tokens;
    if (tokens > 0 && tokens + item.x.size(0) > options_.max_batch_tokens) break;
    tokens += item.x.size(0);
  }
  return tokens;
}

std::vector<Batcher::Item> Batcher::TakeBatch(int layer) {
  std::vector<Item> batch;
  int64_t tokens = 0;
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (it->layer == layer &&
        (tokens == 0 || tokens + it->x.size(0) <= options_.max_batch_tokens)) {
      tokens += it->x.size(0);
      batch.push_back(std::move(*it));
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  return batch;
}

void Batcher::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    // Requests whose deadline passed while they waited are answered, not run.
    std::vector<Item> late = TakeLate();
    if (!late.empty()) {
      lock.unlock();
      AnswerLate(late);
      lock.lock();
      continue;
    }
    if (queue_.empty()) {
      if (stopping_) return;  // nothing left
      continue;               // another worker took it
    }
    const int layer = queue_.front().layer;
    const auto deadline = queue_.front().enqueued + options_.max_queue_delay;
    while (!stopping_ && ReadyTokens(layer) < options_.max_batch_tokens &&
           cv_.wait_until(lock, deadline) != std::cv_status::timeout) {
    }
    std::vector<Item> batch = TakeBatch(layer);
    if (batch.empty()) continue;  // another worker took this layer's requests
    ++batches_;
    if (options_.on_queue_depth) options_.on_queue_depth(static_cast<int64_t>(queue_.size()));
    lock.unlock();
    Run(std::move(batch));
    lock.lock();
  }
}

void Batcher::Run(std::vector<Item> batch) {
  std::vector<at::Tensor> inputs;
  std::vector<int64_t> segments;
  int64_t tokens = 0;
  for (const Item& item : batch) {
    inputs.push_back(item.x);
    segments.push_back(item.x.size(0));
    tokens += item.x.size(0);
  }
  if (options_.on_batch) options_.on_batch(tokens, static_cast<int64_t>(batch.size()));
  absl::StatusOr<LayerResult> result;
  const absl::Status caught = CatchTorchErrors([&] {
    Deadline deadline = Deadline::min();
    for (const Item& item : batch) deadline = std::max(deadline, item.deadline);
    result = compute_(batch.front().layer, inputs.size() == 1 ? inputs[0] : at::cat(inputs),
                      segments, deadline);
    return absl::OkStatus();
  });
  if (!caught.ok()) result = caught;
  int64_t row = 0;
  for (Item& item : batch) {
    const int64_t n = item.x.size(0);
    if (!result.ok()) {
      item.done(result.status());
      continue;
    }
    item.done(LayerResult{result->output.slice(0, row, row + n),
                          result->expert_ids.slice(0, row, row + n),
                          result->weights.slice(0, row, row + n)});
    row += n;
  }
}

}  // namespace himoe::router
