#include "expert_service/run_state_file.h"

#include <fstream>
#include <utility>

#include <google/protobuf/io/zero_copy_stream_impl.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/util/delimited_message_util.h>
#include <google/protobuf/util/message_differencer.h>
#include <glog/logging.h>

#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "expert_service/state_stream.h"

namespace himoe::expert {

absl::Status WriteRunStateFile(const std::string& path, const v1::ExpertShape& shape, int group_id,
                               RunSnapshot snapshot) {
  v1::RunStateHeader header;
  header.set_run_id(snapshot.run_id);
  header.set_world_size(snapshot.world_size);
  header.set_last_applied_step(snapshot.last_applied_step);
  *header.mutable_shape() = shape;
  header.set_group_id(group_id);
  std::string data;
  {
    google::protobuf::io::StringOutputStream out(&data);
    if (!google::protobuf::util::SerializeDelimitedToZeroCopyStream(header, &out)) {
      return absl::DataLossError(
          absl::StrCat("run state file '", path, "': cannot serialize the header"));
    }
    HIMOE_RETURN_IF_ERROR(
        AppendStateChunks(std::move(snapshot.state), kDefaultStateChunkBytes, path, &out));
  }
  return WriteFileAtomically(path, data);
}

absl::StatusOr<std::optional<RunSnapshot>> ReadRunStateFile(const std::string& path,
                                                            const v1::ExpertShape& shape,
                                                            int group_id) {
  if (KindOf(path) == PathKind::kMissing) return std::nullopt;
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("run state file '", path, "' cannot be read"));
  google::protobuf::io::IstreamInputStream stream(&in);
  v1::RunStateHeader header;
  bool clean_eof = false;
  if (!google::protobuf::util::ParseDelimitedFromZeroCopyStream(&header, &stream, &clean_eof)) {
    return absl::DataLossError(
        absl::StrCat("run state file '", path, "': no readable header (truncated or corrupt)"));
  }
  if (header.group_id() != group_id) {
    return absl::FailedPreconditionError(absl::StrCat("run state file '", path,
                                                      "' is expert group ", header.group_id(),
                                                      "'s, not group ", group_id, "'s"));
  }
  if (!google::protobuf::util::MessageDifferencer::Equals(header.shape(), shape)) {
    return absl::FailedPreconditionError(
        absl::StrCat("run state file '", path, "' holds experts of shape {",
                     header.shape().ShortDebugString(), "}, but this group serves {",
                     shape.ShortDebugString(), "} (remove the file to start without it)"));
  }
  RunSnapshot snapshot;
  snapshot.run_id = header.run_id();
  snapshot.world_size = header.world_size();
  snapshot.last_applied_step = header.last_applied_step();
  HIMOE_ASSIGN_OR_RETURN(snapshot.state, ReadStateChunks(&stream, path));
  return snapshot;
}

RunStateWriter::RunStateWriter(std::string path, v1::ExpertShape shape, int group_id)
    : path_(std::move(path)), shape_(std::move(shape)), group_id_(group_id) {
  thread_ = std::thread([this] { Loop(); });
}

RunStateWriter::~RunStateWriter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void RunStateWriter::Submit(RunSnapshot snapshot) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    waiting_ = std::move(snapshot);
  }
  cv_.notify_all();
}

absl::Status RunStateWriter::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return !waiting_.has_value() && !writing_; });
  return last_;
}

int64_t RunStateWriter::written() const {
  std::lock_guard<std::mutex> lock(mu_);
  return written_;
}

void RunStateWriter::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return waiting_.has_value() || stop_; });
    if (!waiting_.has_value()) return;  // stopping, nothing left to write
    RunSnapshot snapshot = std::move(*waiting_);
    waiting_.reset();
    writing_ = true;
    lock.unlock();
    const uint64_t step = snapshot.last_applied_step;
    absl::Status status = WriteRunStateFile(path_, shape_, group_id_, std::move(snapshot));
    if (!status.ok()) LOG(WARNING) << "run state of step " << step << " not written: " << status;
    lock.lock();
    writing_ = false;
    last_ = std::move(status);
    if (last_.ok()) ++written_;
    cv_.notify_all();
  }
}

}  // namespace himoe::expert
