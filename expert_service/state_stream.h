#ifndef HIMOE_EXPERT_SERVICE_STATE_STREAM_H_
#define HIMOE_EXPERT_SERVICE_STATE_STREAM_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/named_tensor.h"
#include "himoe/v1/expert.pb.h"

namespace google::protobuf::io {
class ZeroCopyInputStream;
class ZeroCopyOutputStream;
}  // namespace google::protobuf::io

namespace himoe::expert {

class ExpertServiceCore;

inline constexpr int64_t kDefaultStateChunkBytes = 1 << 20;

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
  absl::Status StartTensor(const v1::StateChunk& chunk);
  absl::Status CheckContinues(const v1::StateChunk& chunk) const;
  absl::Status CheckExtent(const v1::StateChunk& chunk) const;

  Validator validator_;
  std::vector<NamedTensor> done_;
  std::set<std::string> seen_;
  bool open_ = false;  // a tensor is partially received
  v1::Tensor current_;
  std::string current_name_;
  int64_t current_bytes_ = 0;  // expected total
  int64_t chunks_ = 0;
};

// Appends `tensors` to `out` as length-delimited StateChunk messages (`path`
// names the file in errors).
absl::Status AppendStateChunks(std::vector<NamedTensor> tensors, int64_t chunk_bytes,
                               const std::string& path,
                               google::protobuf::io::ZeroCopyOutputStream* out);
// Reads length-delimited StateChunk messages to the end of `in`: the tensors
// in order; DATA_LOSS if truncated, INVALID_ARGUMENT if there are none.
absl::StatusOr<std::vector<NamedTensor>> ReadStateChunks(
    google::protobuf::io::ZeroCopyInputStream* in, const std::string& path,
    StateAssembler::Validator validator = nullptr);

// State files: a length-delimited stream of StateChunk messages, written
// atomically (readers see the old file or the new one).
absl::Status SaveStateToFile(const ExpertServiceCore& core,
                             const std::string& path,
                             int64_t chunk_bytes = kDefaultStateChunkBytes,
                             bool include_optimizer = false);
// Validates every tensor against the core, then applies all of them at once.
absl::Status LoadStateFromFile(const std::string& path,
                               ExpertServiceCore* core);

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_STATE_STREAM_H_
