#ifndef HIMOE_EXPERT_SERVICE_EXPERT_SERVICE_CORE_H_
#define HIMOE_EXPERT_SERVICE_EXPERT_SERVICE_CORE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "expert_service/expert_group.h"
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
};

using NamedTensor = std::pair<std::string, at::Tensor>;

// The transport-free expert-group service: one ExpertGroup per layer.
// Forward may run concurrently from many threads; SetState takes the writer
// side of a shared mutex.
class ExpertServiceCore {
 public:
  static absl::StatusOr<std::unique_ptr<ExpertServiceCore>> Create(
      const ExpertServiceOptions& options);

  ExpertServiceInfo Info() const;
  void FillInfo(v1::ExpertInfoResponse* response) const;

  absl::Status Forward(const v1::ExpertForwardRequest& request,
                       v1::ExpertForwardResponse* response);
  absl::Status Backward(const v1::ExpertBackwardRequest& request,
                        v1::ExpertBackwardResponse* response);
  absl::Status Step(const v1::ExpertStepRequest& request,
                    v1::ExpertStepResponse* response);

  // CPU copies of every parameter, named "layer<L>.<w1|b1|w2|b2>", in layer
  // order. There is no optimizer state yet, so include_optimizer adds nothing.
  absl::StatusOr<std::vector<NamedTensor>> GetState(
      bool include_optimizer = false) const;
  // Validates every (name, tensor) first (known name, exact shape and dtype),
  // then copies all of them in under the writer lock: all or nothing.
  absl::Status SetState(absl::Span<const NamedTensor> tensors);
  absl::Status SetState(const std::string& name, const at::Tensor& tensor);
  // OK if `name` is a parameter of exactly this dtype and shape.
  absl::Status ValidateStateTensor(const std::string& name, c10::ScalarType dtype,
                                   at::IntArrayRef shape) const;

  ExpertServiceCounters counters() const;

  const ExpertServiceOptions& options() const { return options_; }
  int experts_per_group() const { return experts_per_group_; }
  int first_expert() const { return options_.group_id * experts_per_group_; }
  // The layer's group; nullptr for a layer that is not served.
  const ExpertGroup* group(int layer) const;

 private:
  explicit ExpertServiceCore(const ExpertServiceOptions& options);

  absl::Status ForwardImpl(const v1::ExpertForwardRequest& request,
                             v1::ExpertForwardResponse* response);

  ExpertServiceOptions options_;
  int experts_per_group_ = 0;
  std::vector<std::unique_ptr<ExpertGroup>> groups_;  // by layer
  std::map<std::string, at::Tensor> parameters_;      // handles into groups_

  mutable std::shared_mutex state_mutex_;

  std::unique_ptr<std::atomic<int64_t>[]> tokens_;  // [layer * S + s]
  std::atomic<int64_t> forward_requests_{0};
  std::atomic<int64_t> forward_failures_{0};
  std::atomic<int64_t> bytes_in_{0};
  std::atomic<int64_t> bytes_out_{0};
  std::atomic<int64_t> in_flight_{0};
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
                             int64_t chunk_bytes = kDefaultStateChunkBytes);
absl::Status LoadStateFromFile(const std::string& path,
                               ExpertServiceCore* core);

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_EXPERT_SERVICE_CORE_H_
