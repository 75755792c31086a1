#ifndef HIMOE_EXPERT_SERVICE_EXPERT_CLIENT_H_
#define HIMOE_EXPERT_SERVICE_EXPERT_CLIENT_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/generic/generic_stub.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/named_tensor.h"
#include "himoe/v1/expert.grpc.pb.h"
#include "himoe/v1/model.pb.h"
#include "proto/tls_credentials.h"

namespace himoe::expert {

struct ExpertGroupClientOptions {
  int group_id = 0;
  // The group's address first, then its replicas, tried in order.
  std::vector<std::string> addresses;
  std::chrono::milliseconds deadline{10000};
  int max_message_bytes = 64 << 20;
  // Mutual TLS to the group (empty = plaintext).
  TlsFiles tls;
  // A replica's first Forward answer pins its weights fingerprint, unless
  // PinWeights pinned one before (see PinWeights).
  bool pin_weights = false;
  // > 0: an HTTP/2 ping on every connection this often; a connection whose
  // ping is not answered within as long again is closed, failing its calls
  // with UNAVAILABLE (a stopped process, a cut or stalled link). 0 = off: a
  // hung group is found by the calls' deadline alone.
  std::chrono::milliseconds keepalive{0};
  // > 0: once a call has been in flight this long, the group's health
  // service (answered by gRPC, never queued behind the experts' work) is
  // asked, with this deadline, whether the process still answers; if it
  // does not, every call in flight to that address fails at once,
  // UNAVAILABLE naming the group, and later calls to it are checked as soon
  // as they start until it answers again. A keepalive ping waits to be
  // written behind a stalled transfer, and gRPC gives back a call stuck in a
  // stalled connection's write only when TCP gives up; this check bounds the
  // time to find a stopped process or a cut or stalled link at about twice
  // the period. 0 = off.
  std::chrono::milliseconds liveness_check{0};
};

// Client of one expert group (and its replicas). Calls are asynchronous
// (callback stubs); a call that fails with UNAVAILABLE or DEADLINE_EXCEEDED
// moves on to the next replica. Errors name the group and the address;
// transport failures keep their code: "expert group <g> unreachable
// (<address>: <message>; ...)".
class ExpertGroupClient {
 public:
  static absl::StatusOr<std::unique_ptr<ExpertGroupClient>> Create(
      const ExpertGroupClientOptions& options);
  ~ExpertGroupClient();

  using Done = std::function<void(absl::Status)>;
  using Deadline = std::chrono::system_clock::time_point;
  // Start a call; `done` runs once, on a gRPC thread. `request` must stay
  // valid until `done` (a failover sends it again), `response` gets the
  // answer just before it. Forward fails over to replicas; the
  // training calls (Backward, Step, Abort) stay on the first address, which
  // holds the saved activations and the optimizer.
  // Each attempt's deadline is options.deadline from its start, or
  // `deadline` if that comes first (a request's own deadline).
  void ForwardAsync(const v1::ExpertForwardRequest* request,
                    v1::ExpertForwardResponse* response, Done done,
                    Deadline deadline = Deadline::max());
  void BackwardAsync(const v1::ExpertBackwardRequest* request,
                     v1::ExpertBackwardResponse* response, Done done);
  void StepAsync(const v1::ExpertStepRequest* request, v1::ExpertStepResponse* response,
                 Done done);

  // Blocking calls (first address; Info fails over).
  absl::StatusOr<v1::ExpertInfoResponse> Info();
  // `deadline`: for this call (0 = the client's).
  absl::StatusOr<v1::ExpertAbortResponse> Abort(
      uint64_t step, const std::string& run_id = "",
      std::chrono::milliseconds deadline = std::chrono::milliseconds(0));
  // Whether the first address has a connection up now (no call is made) and,
  // with the liveness check, did not leave its last health check unanswered
  // (since when nothing it answered came back).
  bool Connected() const;
  absl::StatusOr<v1::BeginRunResponse> BeginRun(const std::string& run_id, bool take_over = false,
                                                int world_size = 1);
  // The group's state (ExpertServiceCore::GetState names), streamed in chunks.
  absl::StatusOr<std::vector<NamedTensor>> GetState(bool include_optimizer);
  // Streams `state` in chunks of chunk_bytes; the service applies all of it
  // or nothing.
  absl::Status SetState(const std::vector<NamedTensor>& state, int64_t chunk_bytes = 1 << 20);
  // SetState of a model a router serves, to replica `replica` (the group
  // then refuses a BeginRun without take_over); the weights fingerprint the
  // replica reports for it.
  absl::StatusOr<std::string> ServeState(const std::vector<NamedTensor>& state, size_t replica,
                                         int64_t chunk_bytes = 1 << 20);

  // From now on, a Forward answer from replica `replica` must carry
  // `fingerprint` (ExpertForwardResponse.weights_fingerprint): the call
  // fails with FAILED_PRECONDITION naming the group, the address and both
  // fingerprints otherwise, and on_weights_changed hears of it.
  void PinWeights(size_t replica, const std::string& fingerprint);
  std::string pinned_weights(size_t replica) const;  // empty: none
  using WeightsChanged = std::function<void(size_t replica, const std::string& served)>;
  // Runs on a gRPC thread for every answer refused by its fingerprint. Set
  // before the first call.
  void set_on_weights_changed(WeightsChanged f) { on_weights_changed_ = std::move(f); }
  // The Info handshake: the service answering (with failover) must serve this
  // group of exactly `expected` (seed and dtype included); FailedPrecondition
  // naming the address and every differing field otherwise.
  // `info`, if not null, gets the answer.
  absl::Status CheckInfo(const v1::ExpertShape& expected, v1::ExpertInfoResponse* info = nullptr);

  // Calls whose gRPC context is alive. A call releases its context (and the
  // reference to the channel it holds) before its `done` runs, so this is 0
  // when the last `done` runs, and the client may be destroyed right after
  // it (not from inside a `done`: the channels would die on gRPC's thread).
  // A call the liveness check failed is reported at once and given back by
  // gRPC when its connection fails; the destructor waits for that.
  int calls_in_flight() const { return calls_in_flight_.load(std::memory_order_relaxed); }

  // The bytes of the rows, outputs and gradients (RowBytes) Forward and
  // Backward sent, attempts included, and received in answers, since
  // creation: what the calls moved over the link.
  struct RowTraffic {
    int64_t sent = 0;
    int64_t received = 0;
  };
  RowTraffic row_traffic() const {
    return {rows_sent_.load(std::memory_order_relaxed),
            rows_received_.load(std::memory_order_relaxed)};
  }

  int group_id() const { return options_.group_id; }
  const std::vector<std::string>& addresses() const { return options_.addresses; }
  // Calls the liveness check failed (options.liveness_check), since creation.
  int64_t calls_failed_by_liveness_check() const {
    return liveness_failures_.load(std::memory_order_relaxed);
  }

 private:
  struct Call;
  struct Probe;
  // Issues the RPC on a stub with a fresh context; `on_status` gets its status.
  using Start = std::function<void(v1::ExpertService::Stub*, grpc::ClientContext*,
                                   std::function<void(grpc::Status)>)>;
  explicit ExpertGroupClient(const ExpertGroupClientOptions& options)
      : options_(options), pins_(options.addresses.size()) {}
  // OK when replica `replica` serves the weights pinned for it (pinning them
  // first when options.pin_weights and none are).
  absl::Status CheckWeights(size_t replica, const std::string& served);
  absl::StatusOr<std::string> StreamState(const std::vector<NamedTensor>& state,
                                          int64_t chunk_bytes, bool served, size_t replica);
  // `deliver` moves the answer into the caller's message before `done`.
  void StartCall(Start start, bool failover, Done done, std::function<void()> deliver);
  void Attempt(std::shared_ptr<Call> call);
  absl::Status Named(const grpc::Status& status, size_t replica) const;
  // Info from the first replica that answers; sets *replica to its index.
  absl::StatusOr<v1::ExpertInfoResponse> InfoFrom(size_t* replica);
  // The liveness check's thread: asks a replica's health service whenever a
  // call to it is older than options.liveness_check (or the replica left its
  // last check unanswered) and none is asked yet.
  void WatchLiveness();
  void StartProbe(size_t replica);
  // A blocking call to `replica` was answered: it is not silent.
  void Answered(size_t replica);

  ExpertGroupClientOptions options_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::ExpertService::Stub>> stubs_;
  std::vector<std::unique_ptr<grpc::GenericStub>> health_stubs_;  // by replica
  std::atomic<int> calls_in_flight_{0};
  std::atomic<int64_t> rows_sent_{0};
  std::atomic<int64_t> rows_received_{0};
  mutable std::mutex pins_mu_;
  std::vector<std::string> pins_;  // guarded by pins_mu_; by replica
  WeightsChanged on_weights_changed_;

  // The liveness check's state, all guarded by live_mu_.
  mutable std::mutex live_mu_;
  std::condition_variable live_cv_;
  bool stopping_ = false;
  uint64_t next_attempt_ = 0;
  // Attempts whose context is alive (they can be cancelled), by number.
  std::map<uint64_t, Call*> attempts_;
  std::vector<std::shared_ptr<Probe>> probes_;  // by replica; null: none asked
  std::vector<bool> silent_;                    // by replica: failed its last check
  std::atomic<int64_t> liveness_failures_{0};
  std::thread watcher_;
};

// Starts n calls (start(i, done) for each i) and waits for every one of them;
// returns the first error to arrive, OK for n == 0.
absl::Status FanOut(size_t n,
                    const std::function<void(size_t i, ExpertGroupClient::Done done)>& start);

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_EXPERT_CLIENT_H_
