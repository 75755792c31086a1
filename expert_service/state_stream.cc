#include "expert_service/state_stream.h"

#include <algorithm>
#include <fstream>

#include <ATen/ATen.h>
#include <google/protobuf/io/zero_copy_stream_impl.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/util/delimited_message_util.h>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "common/torch_runtime.h"
#include "expert_service/expert_rows.h"
#include "expert_service/expert_service_core.h"

namespace himoe::expert {
namespace {

// Byte count of a (dtype, shape) as declared in a StateChunk.
absl::StatusOr<int64_t> DeclaredBytes(const std::string& name,
                                      c10::ScalarType type,
                                      at::IntArrayRef shape) {
  int64_t bytes = c10::elementSize(type);
  for (const int64_t s : shape) {
    if (s < 0 || __builtin_mul_overflow(bytes, s, &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state '", name, "': shape ", ShapeString(shape),
          " is invalid (negative or overflowing)"));
    }
  }
  return bytes;
}

}  // namespace

// --- StateChunker -----------------------------------------------------------

absl::StatusOr<std::unique_ptr<StateChunker>> StateChunker::Create(
    std::vector<NamedTensor> tensors, int64_t chunk_bytes) {
  if (chunk_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes: ", chunk_bytes, "; expected >= 1"));
  }
  std::vector<Entry> entries;
  entries.reserve(tensors.size());
  for (NamedTensor& named : tensors) {
    std::string& name = named.first;
    const at::Tensor& tensor = named.second;  // (a lambda cannot capture a structured binding)
    if (!tensor.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat("state '", name, "': undefined tensor"));
    }
    HIMOE_ASSIGN_OR_RETURN(const v1::DType dtype, DTypeToProto(tensor.scalar_type()));
    Entry e;
    e.name = std::move(name);
    e.dtype = dtype;
    e.shape.assign(tensor.sizes().begin(), tensor.sizes().end());
    HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
      e.tensor = tensor.detach().to(at::kCPU).contiguous();
      return absl::OkStatus();
    }));
    entries.push_back(std::move(e));
  }
  return std::unique_ptr<StateChunker>(new StateChunker(std::move(entries), chunk_bytes));
}

bool StateChunker::Next(v1::StateChunk* chunk) {
  if (index_ >= entries_.size()) return false;
  Entry& e = entries_[index_];
  const int64_t total = static_cast<int64_t>(e.tensor.nbytes());
  const int64_t n = std::min(chunk_bytes_, total - offset_);
  chunk->Clear();
  chunk->set_name(e.name);
  chunk->set_dtype(e.dtype);
  for (const int64_t s : e.shape) chunk->add_shape(s);
  chunk->set_offset(offset_);
  if (n > 0) {
    chunk->set_data(static_cast<const char*>(e.tensor.data_ptr()) + offset_, n);
  }
  offset_ += n;
  const bool last = offset_ == total;
  chunk->set_last(last);
  if (last) {
    e.tensor.reset();
    ++index_;
    offset_ = 0;
  }
  return true;
}

// --- StateAssembler ---------------------------------------------------------

absl::Status StateAssembler::Add(const v1::StateChunk& chunk) {
  ++chunks_;
  HIMOE_RETURN_IF_ERROR(open_ ? CheckContinues(chunk) : StartTensor(chunk));
  HIMOE_RETURN_IF_ERROR(CheckExtent(chunk));
  current_.mutable_data()->append(chunk.data());
  if (static_cast<int64_t>(current_.data().size()) < current_bytes_) return absl::OkStatus();
  const std::string& name = chunk.name();
  HIMOE_ASSIGN_OR_RETURN(at::Tensor tensor,
                         DecodeTensor(current_, absl::StrCat("state '", name, "'")));
  done_.emplace_back(name, std::move(tensor));
  seen_.insert(name);
  current_.Clear();
  open_ = false;
  return absl::OkStatus();
}

absl::Status StateAssembler::StartTensor(const v1::StateChunk& chunk) {
  const std::string& name = chunk.name();
  if (name.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("state chunk ", chunks_ - 1, ": name is empty"));
  }
  if (seen_.count(name) > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("state chunk for '", name, "': the tensor was already received"));
  }
  auto type = ScalarTypeFromProto(chunk.dtype());
  if (!type.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("state '", name, "'.", type.status().message()));
  }
  const std::vector<int64_t> shape(chunk.shape().begin(), chunk.shape().end());
  HIMOE_ASSIGN_OR_RETURN(current_bytes_, DeclaredBytes(name, *type, shape));
  if (validator_) HIMOE_RETURN_IF_ERROR(validator_(name, *type, shape));
  current_.Clear();
  current_.set_dtype(chunk.dtype());
  *current_.mutable_shape() = chunk.shape();
  current_name_ = name;
  open_ = true;
  return absl::OkStatus();
}

absl::Status StateAssembler::CheckContinues(const v1::StateChunk& chunk) const {
  const std::string& name = chunk.name();
  if (name != current_name_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state chunk for '", name, "' arrived before '", current_name_,
        "' was complete (", current_.data().size(), " of ", current_bytes_,
        " bytes)"));
  }
  if (chunk.dtype() != current_.dtype() ||
      !std::equal(chunk.shape().begin(), chunk.shape().end(),
                  current_.shape().begin(), current_.shape().end())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state chunk for '", name, "' at offset ", chunk.offset(),
        ": dtype or shape differ from the tensor's first chunk"));
  }
  return absl::OkStatus();
}

absl::Status StateAssembler::CheckExtent(const v1::StateChunk& chunk) const {
  const std::string& name = chunk.name();
  const int64_t received = static_cast<int64_t>(current_.data().size());
  const int64_t size = static_cast<int64_t>(chunk.data().size());
  if (chunk.offset() != received) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state chunk for '", name, "': offset ", chunk.offset(), "; expected ",
        received, " (chunks must be contiguous and in order)"));
  }
  if (size > current_bytes_ - received) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state chunk for '", name, "': bytes [", received, ", ", received + size,
        ") run past the tensor's ", current_bytes_, " bytes"));
  }
  const bool complete = received + size == current_bytes_;
  if (chunk.last() != complete) {
    return absl::InvalidArgumentError(
        chunk.last()
            ? absl::StrCat("state chunk for '", name, "': marked last at ",
                           received + size, " of ", current_bytes_, " bytes")
            : absl::StrCat("state chunk for '", name, "': all ", current_bytes_,
                           " bytes received but the chunk is not marked last"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NamedTensor>> StateAssembler::Finish() {
  if (open_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state stream ended with '", current_name_, "' incomplete (",
        current_.data().size(), " of ", current_bytes_, " bytes)"));
  }
  return std::move(done_);
}

// --- State files ------------------------------------------------------------

absl::Status AppendStateChunks(std::vector<NamedTensor> tensors, int64_t chunk_bytes,
                               const std::string& path,
                               google::protobuf::io::ZeroCopyOutputStream* out) {
  HIMOE_ASSIGN_OR_RETURN(auto chunker, StateChunker::Create(std::move(tensors), chunk_bytes));
  v1::StateChunk chunk;
  while (chunker->Next(&chunk)) {
    if (!google::protobuf::util::SerializeDelimitedToZeroCopyStream(chunk, out)) {
      return absl::DataLossError(absl::StrCat("state file '", path,
                                              "': cannot serialize the chunk of '",
                                              chunk.name(), "'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<NamedTensor>> ReadStateChunks(
    google::protobuf::io::ZeroCopyInputStream* in, const std::string& path,
    StateAssembler::Validator validator) {
  StateAssembler assembler(std::move(validator));
  v1::StateChunk chunk;
  for (;;) {
    bool clean_eof = false;
    chunk.Clear();  // parsing merges into the message
    if (!google::protobuf::util::ParseDelimitedFromZeroCopyStream(&chunk, in, &clean_eof)) {
      if (clean_eof) break;
      return absl::DataLossError(absl::StrCat(
          "state file '", path, "': truncated or corrupt after ", assembler.chunks(),
          " chunks"));
    }
    absl::Status status = assembler.Add(chunk);
    if (!status.ok()) {
      return absl::Status(status.code(),
                          absl::StrCat("state file '", path, "': ", status.message()));
    }
  }
  HIMOE_ASSIGN_OR_RETURN(auto tensors, assembler.Finish());
  if (tensors.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("state file '", path, "' holds no tensors"));
  }
  return tensors;
}

absl::Status SaveStateToFile(const ExpertServiceCore& core, const std::string& path,
                             int64_t chunk_bytes, bool include_optimizer) {
  HIMOE_ASSIGN_OR_RETURN(auto state, core.GetState(include_optimizer));
  std::string data;
  {
    google::protobuf::io::StringOutputStream out(&data);
    HIMOE_RETURN_IF_ERROR(AppendStateChunks(std::move(state), chunk_bytes, path, &out));
  }
  return WriteFileAtomically(path, data);
}

absl::Status LoadStateFromFile(const std::string& path, ExpertServiceCore* core) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("state file '", path, "' cannot be read"));
  google::protobuf::io::IstreamInputStream stream(&in);
  HIMOE_ASSIGN_OR_RETURN(const auto tensors,
                         ReadStateChunks(&stream, path,
                                         [core](const std::string& name, c10::ScalarType dtype,
                                                at::IntArrayRef shape) {
                                           return core->ValidateStateTensor(name, dtype, shape);
                                         }));
  return core->SetState(tensors);
}

}  // namespace himoe::expert
