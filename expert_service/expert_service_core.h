#ifndef HIMOE_EXPERT_SERVICE_EXPERT_SERVICE_CORE_H_
#define HIMOE_EXPERT_SERVICE_EXPERT_SERVICE_CORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/named_tensor.h"
#include "common/shared_memory.h"
#include "expert_service/expert_group.h"
#include "expert_service/expert_optimizer.h"
#include "expert_service/expert_rows.h"
#include "expert_service/run_state_file.h"
#include "expert_service/saved_forward_store.h"
#include "himoe/v1/expert.pb.h"
#include "himoe/v1/model.pb.h"

namespace himoe::expert {

inline constexpr char kExpertServiceVersion[] = "himoe-expert/0.1";

struct ExpertServiceOptions {
  // The model's experts; the service holds group `group_id` of every layer.
  v1::ExpertShape shape;
  int group_id = 0;
  c10::Device device{c10::kCPU};
  int64_t max_tokens_per_request = 65536;
  // Saved Forward states at least this old are dropped by the sweep that
  // starts every Forward, Info and Abort call. >= 0.
  absl::Duration saved_state_ttl = absl::Seconds(300);
  // Backward computes the rows' gradient and leaves the weight gradients
  // pending (DeferWeightGradsScope) until RunPendingWeightGrads, the next
  // Backward, or a Step or SetState, which run them first; an Abort or
  // BeginRun drops them with the grads. The gRPC service answers Backward,
  // then runs them, so the weight-gradient products overlap the caller's
  // next work. Off: computed inside Backward.
  bool defer_weight_grads = true;
  // Take rows in, and write outputs to, POSIX shared memory a client on this
  // host names (Tensor.shared, output_slice), each region only with the key
  // its creator sends; off, such rows are refused and outputs come inline.
  // At most max_shared_regions stay open.
  bool shared_memory = false;
  int max_shared_regions = 8;
};

struct ExpertServiceInfo {
  v1::ExpertShape shape;  // as served: the options' shape
  int group_id = 0;
  std::vector<int> expert_ids;
  std::vector<int> layers;
  std::string device;
  std::string version;
  int64_t pending_saved = 0;  // saved Forward states awaiting Backward
  uint64_t last_applied_step = 0;
  std::string run_id;  // the training run begun last; empty before any
  std::string weights_fingerprint;
  bool served = false;  // the weights are a model a router loaded
};

struct ExpertServiceCounters {
  // [layer][local expert]: rows computed by successful Forward calls.
  std::vector<std::vector<int64_t>> tokens_per_layer_expert;
  // [local expert], summed over layers.
  std::vector<int64_t> tokens_per_expert;
  int64_t forward_requests = 0;  // every Forward call, failed ones included
  int64_t forward_failures = 0;
  int64_t bytes_in = 0;   // tensor payload bytes received by Forward
  int64_t bytes_out = 0;  // tensor payload bytes returned by Forward
  int64_t in_flight = 0;  // Forward calls running now (queue depth)
  int64_t pending_saved = 0;  // saved Forward states awaiting Backward
  int64_t saved_expired = 0;  // saved states dropped by the TTL sweep
};

// The transport-free expert-group service: one ExpertGroup per layer, one
// ExpertOptimizer over all of them.
// Forward and Backward may run concurrently from many threads (parameter
// gradient accumulation is serialized); Step and SetState take the writer
// side of a shared mutex, so weights never change under a Forward/Backward.
class ExpertServiceCore {
 public:
  static absl::StatusOr<std::unique_ptr<ExpertServiceCore>> Create(
      const ExpertServiceOptions& options);

  ExpertServiceInfo Info() const;
  void FillInfo(v1::ExpertInfoResponse* response) const;

  // With save_for_backward, the rows become leaves requiring grad (in the
  // group dtype) and the graph is kept under (step, micro_batch, layer,
  // request_id) until Backward, Abort or the TTL; a key in use is
  // ALREADY_EXISTS.
  // Takes the bytes of the request's rows (no copy); the form the gRPC
  // service calls with the request it owns.
  absl::Status Forward(v1::ExpertForwardRequest* request, v1::ExpertForwardResponse* response);
  // As above, on a copy of `request`.
  absl::Status Forward(const v1::ExpertForwardRequest& request,
                       v1::ExpertForwardResponse* response);
  // Consumes the saved Forward (NOT_FOUND if there is none; another run's
  // Backward is FAILED_PRECONDITION and consumes nothing): checks that the
  // output grads match its outputs, accumulates the parameter grads, returns
  // the input grads in the dtype of each output grad. FAILED_PRECONDITION if
  // a Step or SetState changed the weights since that Forward. The saved
  // state is freed whether or not the backward succeeds.
  // Takes the bytes of the request's output grads, like Forward.
  absl::Status Backward(v1::ExpertBackwardRequest* request,
                        v1::ExpertBackwardResponse* response);
  absl::Status Backward(const v1::ExpertBackwardRequest& request,
                        v1::ExpertBackwardResponse* response);
  // norm_only: reports the squared grad norm. Otherwise an ExpertOptimizer
  // step (idempotent per step id) reporting the norm before grad_scale.
  absl::Status Step(const v1::ExpertStepRequest& request,
                    v1::ExpertStepResponse* response);
  // Drops the saved Forward states of request.step (all of them when 0).
  absl::Status Abort(const v1::ExpertAbortRequest& request,
                     v1::ExpertAbortResponse* response);
  // Starts run request.run_id: weights back to the seed's, optimizer state
  // and grads zeroed, saved Forwards dropped, last_applied_step 0.
  // FAILED_PRECONDITION, changing nothing, while the weights are a served
  // model (SetState with `served`) and the request does not take over.
  absl::Status BeginRun(const v1::BeginRunRequest& request, v1::BeginRunResponse* response);

  // Computes the weight gradients the Backwards left pending (in their
  // order) and adds them to the grads; a no-op when none are.
  absl::Status RunPendingWeightGrads();
  // Backwards whose weight gradients are pending.
  int64_t pending_weight_grads() const;

  // Saved Forward states awaiting Backward (no sweep).
  int64_t pending_saved() const;
  uint64_t last_applied_step() const {
    return last_applied_step_.load(std::memory_order_relaxed);
  }

  // CPU copies of every parameter, named "layer<L>.<w1|b1|w2|b2>", in layer
  // order; with include_optimizer, then ExpertOptimizer::State().
  absl::StatusOr<std::vector<NamedTensor>> GetState(
      bool include_optimizer = false) const;
  // Validates every (name, tensor) first (known name, exact shape and dtype;
  // parameters and ExpertOptimizer::State() names), then applies all of them
  // under the writer lock: all or nothing. `served`: the state is a model a
  // router serves (BeginRun then needs take_over). `fingerprint`, if not
  // null: the weights fingerprint once they are set.
  absl::Status SetState(absl::Span<const NamedTensor> tensors, bool served = false,
                        std::string* fingerprint = nullptr);
  absl::Status SetState(const std::string& name, const at::Tensor& tensor);
  // Serves the run of `snapshot` (a run state file) from its last applied
  // step: its weights and AdamW state (SetState), run id and world size.
  // DATA_LOSS if the optimizer state is of another step than the header's.
  absl::Status RestoreRun(const RunSnapshot& snapshot);
  // Called by every Step that applies, under the writer lock, with the state
  // it left (CPU copies of the weights and the AdamW state: the copy costs
  // three times the weights' bytes per step). Set before serving.
  void set_run_snapshot_sink(std::function<void(RunSnapshot)> sink) {
    run_snapshot_sink_ = std::move(sink);
  }
  // OK if `name` is a parameter or optimizer state entry of exactly this
  // dtype and shape.
  absl::Status ValidateStateTensor(const std::string& name, c10::ScalarType dtype,
                                   at::IntArrayRef shape) const;

  ExpertServiceCounters counters() const;
  // Called after every Forward with its compute time in seconds. Set before
  // serving; not thread-safe to change while Forward runs.
  void set_forward_observer(std::function<void(double)> observer) {
    forward_observer_ = std::move(observer);
  }

  const ExpertServiceOptions& options() const { return options_; }
  int experts_per_group() const { return experts_per_group_; }
  int first_expert() const { return options_.group_id * experts_per_group_; }
  // The layer's group; nullptr for a layer that is not served.
  const ExpertGroup* group(int layer) const;

 private:
  ExpertServiceCore(const ExpertServiceOptions& options, c10::ScalarType dtype);

  // The request's layer and size limits, before anything is decoded.
  absl::Status CheckForwardRequest(const v1::ExpertForwardRequest& request) const;
  absl::Status ForwardImpl(v1::ExpertForwardRequest* request,
                           v1::ExpertForwardResponse* response);
  // Runs the layer's group on the decoded rows and encodes the outputs; with
  // `saved`, keeps the graph there.
  absl::Status ComputeForward(const v1::ExpertForwardRequest& request,
                              const std::vector<at::Tensor>& rows, SavedForward* saved,
                              v1::ExpertForwardResponse* response);
  // As ComputeForward, for a request's TokenAssignments: one combined row
  // each.
  absl::Status ComputeCombined(const v1::ExpertForwardRequest& request, const DecodedTokens& tokens,
                               SavedForward* saved, v1::ExpertForwardResponse* response);
  absl::Status BackwardImpl(const SavedKey& key, SavedForward& saved,
                            v1::ExpertBackwardRequest* request,
                            v1::ExpertBackwardResponse* response);
  // BackwardImpl for a saved Forward of TokenAssignments (or a request that
  // sends combined_grad).
  absl::Status CombinedBackward(const SavedKey& key, SavedForward& saved,
                                v1::ExpertBackwardRequest* request,
                                v1::ExpertBackwardResponse* response);
  // Backward of a saved Forward: dL/d(input); its parameter gradients are
  // added to trainer rank `rank`'s sums, in `position`'s order when it has
  // one (ExpertBackwardRequest.grad_position).
  absl::StatusOr<at::Tensor> RunBackward(const SavedKey& key, SavedForward& saved, int rank,
                                         std::optional<uint32_t> position,
                                         const std::vector<at::Tensor>& grads);
  // Queues a positioned Backward's weight-gradient work; whatever is next in
  // its (rank, layer) order goes to the pending work. Under grad_mutex_.
  void QueueInOrderLocked(int rank, int layer, uint32_t position, DeferredWeightGrads work);
  // OK unless a positioned Backward's weight gradients still wait for an
  // earlier position (which never came): then FAILED_PRECONDITION naming it.
  // Under grad_mutex_.
  absl::Status CheckNoneWaitingLocked(const char* rpc) const;
  int num_layers() const { return options_.shape.num_layers(); }
  // GetState with state_mutex_ held (either side).
  absl::StatusOr<std::vector<NamedTensor>> GetStateLocked(bool include_optimizer) const;
  // Caller holds state_mutex_ (either side) and grad_mutex_: runs the
  // pending weight gradients. After an error the grads are incomplete: it
  // is returned, the rest are dropped, and every later call returns it
  // until an Abort or BeginRun.
  absl::Status RunPendingWeightGradsLocked();
  // Caller holds state_mutex_'s writer side and is about to zero the grads:
  // forgets the pending weight gradients and their error.
  void DropPendingWeightGrads();
  // Caller holds state_mutex_ (either side): OK if `run_id` is the run begun
  // last.
  absl::Status CheckRun(const char* rpc, uint64_t step, const std::string& run_id) const;
  // CheckRun, then the trainer ranks: `world_size` (0 = 1) must be the
  // run's, `rank` below it. Under state_mutex_.
  absl::Status CheckRanks(const char* rpc, uint64_t step, const std::string& run_id,
                          uint32_t world_size, uint32_t rank) const;
  // Makes the parameters' .grad hold rank `rank`'s sums, parking the rank's
  // they held. Under grad_mutex_.
  void UseRankGradsLocked(int rank);
  // Every rank's sums added into the parameters' .grad, in rank order (so
  // that they do not depend on the order the ranks' calls came in). Under
  // grad_mutex_.
  void FoldRankGradsLocked();
  // ExpertInfoResponse.weights_fingerprint. Caller holds state_mutex_.
  std::string weights_fingerprint() const;
  // SHA-256 of every parameter (names and bytes, in name order), 16 hex
  // digits. Caller holds state_mutex_ (either side) or owns the core.
  absl::StatusOr<std::string> DigestWeights() const;

  ExpertServiceOptions options_;
  c10::ScalarType dtype_;  // of the experts, from the shape
  int experts_per_group_ = 0;
  std::vector<std::unique_ptr<ExpertGroup>> groups_;  // by layer
  std::map<std::string, at::Tensor> parameters_;      // handles into groups_
  std::unique_ptr<ExpertOptimizer> optimizer_;        // over groups_

  // Shared: Forward, Backward, GetState, norm-only Step. Exclusive: Step,
  // SetState.
  mutable std::shared_mutex state_mutex_;
  // Serializes parameter .grad accumulation (Backward) and reading it.
  mutable std::mutex grad_mutex_;
  DeferredWeightGrads pending_weight_grads_;  // guarded by grad_mutex_
  std::vector<int> pending_ranks_;            // each one's trainer rank; grad_mutex_
  // Positioned Backwards of the step by (rank, layer): the next position to
  // add, and the work of later ones that came first. Guarded by grad_mutex_.
  struct GradOrder {
    uint32_t next = 0;
    std::map<uint32_t, DeferredWeightGrads> waiting;
  };
  std::map<std::pair<int, int>, GradOrder> grad_orders_;
  // The parameters whose .grad Backward adds to, in a fixed order; the rank
  // whose sums they hold, and every other rank's ([rank][parameter]).
  // Guarded by grad_mutex_.
  std::vector<at::Tensor> grad_params_;
  int grads_rank_ = 0;
  std::vector<std::vector<at::Tensor>> parked_grads_;
  uint32_t run_world_size_ = 1;              // guarded by state_mutex_
  absl::Status weight_grads_error_;          // guarded by grad_mutex_
  // Bookkeeping only, so Info (const) sweeps it too.
  mutable SavedForwardStore saved_;
  std::atomic<uint64_t> last_applied_step_{0};
  std::string run_id_;  // guarded by state_mutex_
  bool served_ = false;  // guarded by state_mutex_
  // weights_fingerprint(): a digest of the weights as set last (start,
  // BeginRun, SetState), and the Steps applied since. Guarded by
  // state_mutex_.
  std::string weights_digest_;
  uint64_t steps_since_digest_ = 0;
  std::string seed_digest_;  // of the seed's weights
  // Bumped (under the writer lock) whenever Step or SetState changes weights:
  // a saved Forward from before cannot be differentiated any more.
  std::atomic<uint64_t> weights_version_{0};

  std::unique_ptr<std::atomic<int64_t>[]> tokens_;  // [layer * S + s]
  std::atomic<int64_t> forward_requests_{0};
  std::atomic<int64_t> forward_failures_{0};
  std::unique_ptr<SharedMemoryAttachments> shared_;  // null: shared memory off
  std::atomic<int64_t> bytes_in_{0};
  std::atomic<int64_t> bytes_out_{0};
  std::atomic<int64_t> in_flight_{0};
  std::function<void(double)> forward_observer_;
  std::function<void(RunSnapshot)> run_snapshot_sink_;
};

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_EXPERT_SERVICE_CORE_H_
