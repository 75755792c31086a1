#ifndef HIMOE_EXPERT_SERVICE_EXPERT_SERVICE_CORE_H_
#define HIMOE_EXPERT_SERVICE_EXPERT_SERVICE_CORE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
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
#include "expert_service/expert_group.h"
#include "expert_service/expert_optimizer.h"
#include "himoe/v1/expert.pb.h"

namespace himoe::expert {

inline constexpr char kExpertServiceVersion[] = "himoe-expert/0.1";
inline constexpr int64_t kDefaultStateChunkBytes = 1 << 20;

struct ExpertServiceOptions {
  int group_id = 0;
  int num_groups = 1;
  int num_experts = 1;  // N, over all groups; N / num_groups per group
  int num_layers = 1;   // the service holds layers [0, num_layers)
  int64_t d_model = 0;
  int64_t d_ff = 0;
  uint64_t seed = 0;
  c10::Device device = c10::Device(c10::kCPU);
  c10::ScalarType dtype = c10::kFloat;  // kFloat or kBFloat16
  int64_t max_tokens_per_request = 65536;
  // Saved Forward states at least this old are dropped by the sweep that
  // starts every Forward, Info and Abort call. >= 0.
  absl::Duration saved_state_ttl = absl::Seconds(300);
};

struct ExpertServiceInfo {
  int group_id = 0;
  int num_groups = 0;
  int num_experts = 0;
  std::vector<int> expert_ids;
  std::vector<int> layers;
  int64_t d_model = 0;
  int64_t d_ff = 0;
  c10::ScalarType dtype = c10::kFloat;
  std::string device;
  std::string version;
  int64_t pending_saved = 0;  // saved Forward states awaiting Backward
  uint64_t last_applied_step = 0;
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
  absl::Status Forward(const v1::ExpertForwardRequest& request,
                       v1::ExpertForwardResponse* response);
  // Consumes the saved Forward (NOT_FOUND if there is none): checks that the
  // output grads match its outputs, accumulates the parameter grads, returns
  // the input grads in the dtype of each output grad. FAILED_PRECONDITION if
  // a Step or SetState changed the weights since that Forward. The saved
  // state is freed whether or not the backward succeeds.
  absl::Status Backward(const v1::ExpertBackwardRequest& request,
                        v1::ExpertBackwardResponse* response);
  // norm_only: reports the squared grad norm. Otherwise an ExpertOptimizer
  // step (idempotent per step id) reporting the norm before grad_scale.
  absl::Status Step(const v1::ExpertStepRequest& request,
                    v1::ExpertStepResponse* response);
  // Drops the saved Forward states of request.step (all of them when 0).
  absl::Status Abort(const v1::ExpertAbortRequest& request,
                     v1::ExpertAbortResponse* response);

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
  // under the writer lock: all or nothing.
  absl::Status SetState(absl::Span<const NamedTensor> tensors);
  absl::Status SetState(const std::string& name, const at::Tensor& tensor);
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
  explicit ExpertServiceCore(const ExpertServiceOptions& options);

  // (step, micro_batch, layer, request_id) of a saved Forward.
  struct SavedKey {
    uint64_t step = 0;
    uint32_t micro_batch = 0;
    int32_t layer = 0;
    uint64_t request_id = 0;
    bool operator<(const SavedKey& o) const;
    std::string DebugString() const;
  };
  struct SavedForward {
    at::Tensor input;   // [rows, d] leaf in the group dtype, requires grad
    at::Tensor output;  // [rows, d] with its graph
    std::vector<int32_t> expert_ids;  // per request input
    std::vector<int64_t> rows;        // per request input
    uint64_t weights_version = 0;     // weights_version_ at Forward time
    std::chrono::steady_clock::time_point created;
  };

  absl::Status ForwardImpl(const v1::ExpertForwardRequest& request,
                             v1::ExpertForwardResponse* response);
  absl::Status BackwardImpl(const SavedKey& key, SavedForward& saved,
                            const v1::ExpertBackwardRequest& request,
                            v1::ExpertBackwardResponse* response);
  // Drops saved states at least saved_state_ttl old. Bookkeeping only, hence
  // const (Info sweeps too).
  void SweepExpiredSaved() const;

  ExpertServiceOptions options_;
  int experts_per_group_ = 0;
  std::vector<std::unique_ptr<ExpertGroup>> groups_;  // by layer
  std::map<std::string, at::Tensor> parameters_;      // handles into groups_
  std::unique_ptr<ExpertOptimizer> optimizer_;        // over groups_

  // Shared: Forward, Backward, GetState, norm-only Step. Exclusive: Step,
  // SetState.
  mutable std::shared_mutex state_mutex_;
  // Serializes parameter .grad accumulation (Backward) and reading it.
  std::mutex grad_mutex_;
  mutable std::mutex saved_mutex_;
  mutable std::map<SavedKey, SavedForward> saved_;  // guarded by saved_mutex_
  mutable std::atomic<int64_t> saved_expired_{0};
  std::atomic<uint64_t> last_applied_step_{0};
  // Bumped (under the writer lock) whenever Step or SetState changes weights:
  // a saved Forward from before cannot be differentiated any more.
  std::atomic<uint64_t> weights_version_{0};

  std::unique_ptr<std::atomic<int64_t>[]> tokens_;  // [layer * S + s]
  std::atomic<int64_t> forward_requests_{0};
  std::atomic<int64_t> forward_failures_{0};
  std::atomic<int64_t> bytes_in_{0};
  std::atomic<int64_t> bytes_out_{0};
  std::atomic<int64_t> in_flight_{0};
  std::function<void(double)> forward_observer_;
};

// Splits named tensors into StateChunk messages of at most chunk_bytes data
// bytes each. Every chunk repeats name, dtype and shape; `last` marks the
// final chunk of a tensor (an empty tensor is one empty chunk).
class StateChunker {
 public:
  static absl::StatusOr<std::unique_ptr<StateChunker>> Create(
      std::vector<NamedTensor> tensors, int64_t chunk_bytes);

  // Fills `chunk` with the next chunk; false once every tensor is sent.
  bool Next(v1::StateChunk* chunk);

 private:
  struct Entry {
    std::string name;
    v1::DType dtype;
    std::vector<int64_t> shape;
    at::Tensor tensor;  // contiguous, on the CPU
  };
  StateChunker(std::vector<Entry> entries, int64_t chunk_bytes)
      : entries_(std::move(entries)), chunk_bytes_(chunk_bytes) {}

  std::vector<Entry> entries_;
  int64_t chunk_bytes_;
  size_t index_ = 0;
  int64_t offset_ = 0;
};

// The reverse of StateChunker: checks that the chunks of each tensor arrive
// in order, contiguous, with consistent metadata, and that every tensor is
// complete before the next one starts.
class StateAssembler {
 public:
  // Called on the first chunk of each tensor, before its bytes are buffered.
  using Validator = std::function<absl::Status(
      const std::string& name, c10::ScalarType dtype, at::IntArrayRef shape)>;

  explicit StateAssembler(Validator validator = nullptr)
      : validator_(std::move(validator)) {}

  absl::Status Add(const v1::StateChunk& chunk);
  // Fails if a tensor is incomplete; returns the tensors in arrival order.
  absl::StatusOr<std::vector<NamedTensor>> Finish();

  int64_t chunks() const { return chunks_; }

 private:
  Validator validator_;
  std::vector<NamedTensor> done_;
  std::set<std::string> seen_;
  bool open_ = false;  // a tensor is partially received
  v1::Tensor current_;
  std::string current_name_;
  int64_t current_bytes_ = 0;  // expected total
  int64_t chunks_ = 0;
};

// State files: a length-delimited stream of StateChunk messages.
absl::Status SaveStateToFile(const ExpertServiceCore& core,
                             const std::string& path,
                             int64_t chunk_bytes = kDefaultStateChunkBytes,
                             bool include_optimizer = false);
absl::Status LoadStateFromFile(const std::string& path,
                               ExpertServiceCore* core);

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_EXPERT_SERVICE_CORE_H_
