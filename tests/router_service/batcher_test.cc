#include "router_service/batcher.h"

#include <condition_variable>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace himoe::router {
namespace {

// Requests queued while a batch computes are merged into the next batch and
// each gets exactly its own rows back; layers are never mixed.
TEST(BatcherTest, MergesQueuedRequestsOfTheSameLayerAndSplitsResults) {
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::vector<std::pair<int, int64_t>> computed;  // (layer, rows)
  std::vector<std::vector<int64_t>> segments;     // per batch
  BatcherOptions options;
  options.max_batches_in_flight = 1;
  options.max_batch_tokens = 100;
  options.max_queue_delay = std::chrono::microseconds(0);
  auto batcher = std::make_unique<Batcher>(
      options, [&](int layer, const at::Tensor& x, const std::vector<int64_t>& rows,
                   Batcher::Deadline) -> absl::StatusOr<LayerResult> {
        std::unique_lock<std::mutex> lock(mu);
        computed.push_back({layer, x.size(0)});
        segments.push_back(rows);
        cv.notify_all();
        cv.wait(lock, [&] { return release; });
        // Output = input * (layer + 2); ids = row index within the batch.
        return LayerResult{x * (layer + 2), at::arange(x.size(0)).unsqueeze(1),
                           at::ones({x.size(0), 1})};
      });
  std::vector<absl::StatusOr<LayerResult>> results(6, absl::UnknownError("unset"));
  std::vector<at::Tensor> inputs;
  const int layers[] = {0, 0, 0, 1, 0, 0};
  const int64_t rows[] = {4, 10, 20, 7, 60, 30};
  for (int i = 0; i < 6; ++i) inputs.push_back(at::randn({rows[i], 3}));
  batcher->Submit(layers[0], inputs[0], [&](auto r) { results[0] = std::move(r); });
  {  // wait until the first batch is computing, then queue the rest
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(30), [&] { return !computed.empty(); });
  }
  for (int i = 1; i < 6; ++i) {
    batcher->Submit(layers[i], inputs[i], [&, i](auto r) { results[i] = std::move(r); });
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  batcher.reset();  // drains the queue
  // Batches: {0}; layer 0 {1,2,4} (10+20+60 = 90 <= 100; 30 more would not fit);
  // then layer-1 request 3 or the rest of layer 0, in arrival order of the head.
  ASSERT_EQ(computed.size(), 4u);
  EXPECT_EQ(computed[0], (std::pair<int, int64_t>{0, 4}));
  EXPECT_EQ(computed[1], (std::pair<int, int64_t>{0, 90}));
  EXPECT_EQ(computed[2], (std::pair<int, int64_t>{1, 7}));
  EXPECT_EQ(computed[3], (std::pair<int, int64_t>{0, 30}));
  // Each batch names its requests' rows, in order (capacity per request).
  EXPECT_THAT(segments, ::testing::ElementsAre(std::vector<int64_t>{4},
                                               std::vector<int64_t>{10, 20, 60},
                                               std::vector<int64_t>{7},
                                               std::vector<int64_t>{30}));
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(results[i].ok()) << i;
    EXPECT_TRUE(at::allclose(results[i]->output, inputs[i] * (layers[i] + 2))) << i;
    EXPECT_EQ(results[i]->output.size(0), rows[i]);
  }
  // Request 4 sat at rows [30, 90) of its batch.
  EXPECT_EQ(results[4]->expert_ids[0][0].item<int64_t>(), 30);
}

// A compute that holds every batch until Release(), so that a test can fill
// the queue behind a batch in flight; counts the rows it computed.
class HeldCompute {
 public:
  Batcher::Compute Fn() {
    return [this](int, const at::Tensor& x, const std::vector<int64_t>&,
                  Batcher::Deadline) -> absl::StatusOr<LayerResult> {
      std::unique_lock<std::mutex> lock(mu_);
      computing_ = true;
      rows_ += x.size(0);
      cv_.notify_all();
      cv_.wait(lock, [&] { return released_; });
      return LayerResult{x, at::zeros({x.size(0), 1}, at::kLong), at::ones({x.size(0), 1})};
    };
  }
  void WaitUntilComputing() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(30), [&] { return computing_; });
  }
  void Release() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      released_ = true;
    }
    cv_.notify_all();
  }
  int64_t rows() {
    std::lock_guard<std::mutex> lock(mu_);
    return rows_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool computing_ = false, released_ = false;
  int64_t rows_ = 0;
};

// One batch in flight, no queue delay, room for two waiting requests.
BatcherOptions OneBatchQueueOfTwo() {
  BatcherOptions options;
  options.max_batches_in_flight = 1;
  options.max_queue_delay = std::chrono::microseconds(0);
  options.max_queue_requests = 2;
  options.queue_limit_name = "router.max_queue_requests";
  return options;
}

// Beyond max_queue_requests waiting, a request is refused at once, naming
// the limit; the queued ones are computed.
TEST(BatcherTest, AFullQueueIsResourceExhaustedAtOnce) {
  HeldCompute held;
  BatcherOptions options = OneBatchQueueOfTwo();
  std::vector<int64_t> depths;
  options.on_queue_depth = [&depths](int64_t d) { depths.push_back(d); };
  auto batcher = std::make_unique<Batcher>(options, held.Fn());
  std::vector<absl::Status> results(4, absl::UnknownError("unset"));
  batcher->Submit(0, at::randn({2, 3}), [&](auto r) { results[0] = r.status(); });
  held.WaitUntilComputing();
  // Layer 1, so that the two cannot join the batch in flight.
  for (int i = 1; i < 4; ++i) {
    batcher->Submit(1, at::randn({2, 3}), [&, i](auto r) { results[i] = r.status(); });
  }
  EXPECT_EQ(results[3].code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(results[3].message(),
            "router queue full: 2 requests waiting (router.max_queue_requests = 2); retry later");
  held.Release();
  batcher.reset();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(results[i].ok()) << i << ": " << results[i];
  EXPECT_THAT(depths, ::testing::Contains(2));
  EXPECT_EQ(depths.back(), 0);
}

// With two batches in flight, a second batch computes while the first still
// waits (for its groups): the first is released only by the second starting.
TEST(BatcherTest, TwoBatchesComputeAtOnce) {
  std::mutex mu;
  std::condition_variable cv;
  int started = 0;
  BatcherOptions options;
  options.max_batches_in_flight = 2;
  options.max_queue_delay = std::chrono::microseconds(0);
  Batcher batcher(options, [&](int layer, const at::Tensor& x, const std::vector<int64_t>&,
                               Batcher::Deadline) -> absl::StatusOr<LayerResult> {
    std::unique_lock<std::mutex> lock(mu);
    ++started;
    cv.notify_all();
    if (!cv.wait_for(lock, std::chrono::seconds(30), [&] { return started == 2; })) {
      return absl::DeadlineExceededError("the other batch never started");
    }
    return LayerResult{x * (layer + 2), at::zeros({x.size(0), 1}, at::kLong),
                       at::ones({x.size(0), 1})};
  });
  std::vector<absl::StatusOr<LayerResult>> results(2, absl::UnknownError("unset"));
  std::vector<at::Tensor> inputs = {at::randn({3, 4}), at::randn({5, 4})};
  int done = 0;
  for (int i = 0; i < 2; ++i) {
    batcher.Submit(i, inputs[i], [&, i](auto r) {
      std::lock_guard<std::mutex> lock(mu);
      results[i] = std::move(r);
      ++done;
      cv.notify_all();
    });
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait_for(lock, std::chrono::seconds(60), [&] { return done == 2; });
  ASSERT_EQ(done, 2);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i].status();
    EXPECT_TRUE(at::allclose(results[i]->output, inputs[i] * (i + 2))) << i;
  }
}

TEST(BatcherTest, ErrorsReachEveryCallerOfTheBatch) {
  BatcherOptions options;
  Batcher batcher(options, [](int, const at::Tensor&, const std::vector<int64_t>&,
                              Batcher::Deadline) -> absl::StatusOr<LayerResult> {
    return absl::UnavailableError("expert group 1 unreachable");
  });
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  absl::Status last;
  for (int i = 0; i < 3; ++i) {
    batcher.Submit(0, at::randn({2, 3}), [&](auto r) {
      std::lock_guard<std::mutex> lock(mu);
      last = r.status();
      ++done;
      cv.notify_all();
    });
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait_for(lock, std::chrono::seconds(30), [&] { return done == 3; });
  EXPECT_EQ(done, 3);
  EXPECT_EQ(last.code(), absl::StatusCode::kUnavailable);
}

// A request whose deadline passed while it waited behind the batch in flight
// is answered DEADLINE_EXCEEDED and never computed; the others of its layer
// are, with the latest of their deadlines.
TEST(BatcherTest, ARequestThatExpiredInTheQueueIsNotComputed) {
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::vector<int64_t> computed;  // rows per batch
  std::vector<Batcher::Deadline> deadlines;
  BatcherOptions options;
  options.max_batches_in_flight = 1;  // the request waits behind the batch in flight
  options.max_queue_delay = std::chrono::microseconds(0);
  auto batcher = std::make_unique<Batcher>(
      options, [&](int, const at::Tensor& x, const std::vector<int64_t>&,
                   Batcher::Deadline d) -> absl::StatusOr<LayerResult> {
        std::unique_lock<std::mutex> lock(mu);
        computed.push_back(x.size(0));
        deadlines.push_back(d);
        cv.notify_all();
        cv.wait(lock, [&] { return release; });
        return LayerResult{x, at::zeros({x.size(0), 1}, at::kLong), at::ones({x.size(0), 1})};
      });
  std::vector<absl::StatusOr<LayerResult>> results(4, absl::UnknownError("unset"));
  batcher->Submit(0, at::randn({1, 3}), [&](auto r) { results[0] = std::move(r); });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(30), [&] { return !computed.empty(); });
  }
  const auto now = std::chrono::system_clock::now();
  const auto later = now + std::chrono::hours(1);
  batcher->Submit(0, at::randn({2, 3}), [&](auto r) { results[1] = std::move(r); }, now);
  batcher->Submit(0, at::randn({3, 3}), [&](auto r) { results[2] = std::move(r); }, later);
  batcher->Submit(0, at::randn({4, 3}), [&](auto r) { results[3] = std::move(r); },
                  later - std::chrono::minutes(1));
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  batcher.reset();  // drains the queue
  ASSERT_EQ(computed, (std::vector<int64_t>{1, 7}));
  EXPECT_EQ(deadlines[0], Batcher::Deadline::max());  // no deadline given
  EXPECT_EQ(deadlines[1], later);
  EXPECT_EQ(results[1].status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(results[1].status().message().find("not computed"), std::string::npos);
  for (int i : {0, 2, 3}) EXPECT_TRUE(results[i].ok()) << i << ": " << results[i].status();
  EXPECT_EQ(results[3]->output.size(0), 4);
}

// A caller-made batch (Generate's step) does not wait max_queue_delay for
// company: with an hour's delay, a request already waiting and the two of
// SubmitBatched leave at once, as one batch, each answered with its own rows.
TEST(BatcherTest, ACallerMadeBatchStartsAtOnceWithWhatIsQueued) {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::vector<int64_t>> segments;
  BatcherOptions options;
  options.max_batches_in_flight = 1;
  options.max_batch_tokens = 100;
  options.max_queue_delay = std::chrono::hours(1);
  Batcher batcher(options, [&](int layer, const at::Tensor& x, const std::vector<int64_t>& rows,
                               Batcher::Deadline) -> absl::StatusOr<LayerResult> {
    std::lock_guard<std::mutex> lock(mu);
    segments.push_back(rows);
    return LayerResult{x * (layer + 2), at::zeros({x.size(0), 1}, at::kLong),
                       at::ones({x.size(0), 1})};
  });
  const std::vector<at::Tensor> inputs = {at::randn({3, 4}), at::randn({1, 4}), at::randn({2, 4})};
  std::vector<absl::StatusOr<LayerResult>> results(3, absl::UnknownError("unset"));
  int answered = 0;
  const auto answer = [&](int i) {
    return [&, i](absl::StatusOr<LayerResult> r) {
      std::lock_guard<std::mutex> lock(mu);
      results[i] = std::move(r);
      ++answered;
      cv.notify_all();
    };
  };
  batcher.Submit(0, inputs[0], answer(0));  // would wait the hour for company
  batcher.SubmitBatched(0, {inputs[1], inputs[2]}, {answer(1), answer(2)});
  {
    std::unique_lock<std::mutex> lock(mu);
    // Not a timing: an hour's wait would fail it, anything short passes.
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return answered == 3; }));
  }
  EXPECT_EQ(batcher.batches(), 1);
  ASSERT_EQ(segments.size(), 1u);
  EXPECT_EQ(segments[0], (std::vector<int64_t>{3, 1, 2}));
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(results[i].ok()) << i << ": " << results[i].status();
    EXPECT_TRUE(at::equal(results[i]->output, inputs[i] * 2)) << i;
  }
}

// SubmitBatched on a queue without room for all of its requests answers all
// of them RESOURCE_EXHAUSTED (none is computed); what was queued still runs.
TEST(BatcherTest, ACallerMadeBatchThatDoesNotFitIsRefusedWhole) {
  HeldCompute held;
  BatcherOptions options = OneBatchQueueOfTwo();
  auto batcher = std::make_unique<Batcher>(options, held.Fn());
  std::vector<absl::Status> results(4, absl::UnknownError("unset"));
  batcher->Submit(0, at::randn({2, 3}), [&](auto r) { results[0] = r.status(); });
  held.WaitUntilComputing();
  batcher->Submit(1, at::randn({5, 3}), [&](auto r) { results[1] = r.status(); });
  batcher->SubmitBatched(1, {at::randn({7, 3}), at::randn({11, 3})},
                         {[&](auto r) { results[2] = r.status(); },
                          [&](auto r) { results[3] = r.status(); }});
  for (int i : {2, 3}) {
    EXPECT_EQ(results[i].code(), absl::StatusCode::kResourceExhausted) << i;
    EXPECT_EQ(results[i].message(),
              "router queue full: 1 requests waiting and 2 more (router.max_queue_requests = "
              "2); retry later");
  }
  held.Release();
  batcher.reset();
  EXPECT_TRUE(results[0].ok()) << results[0];
  EXPECT_TRUE(results[1].ok()) << results[1];
  EXPECT_EQ(held.rows(), 2 + 5);  // the refused 7 and 11 rows never ran
}

}  // namespace
}  // namespace himoe::router
