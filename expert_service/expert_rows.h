#ifndef HIMOE_EXPERT_SERVICE_EXPERT_ROWS_H_
#define HIMOE_EXPERT_SERVICE_EXPERT_ROWS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <google/protobuf/repeated_ptr_field.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/shared_memory.h"
#include "himoe/v1/expert.pb.h"

namespace himoe::expert {

using ExpertRowsList = google::protobuf::RepeatedPtrField<v1::ExpertRows>;

// "[2, 3]".
std::string ShapeString(at::IntArrayRef shape);

// Checks entry `index` (named `field`, e.g. "inputs[1]") of a request's rows
// for its expert id; InvalidArgument naming the field otherwise.
using ExpertIdCheck =
    std::function<absl::Status(int index, const std::string& field, int32_t expert_id)>;

// Decodes the rows of a request on the service side: `entries` are the
// "inputs" of a Forward or the "output_grads" of a Backward (`name`). Entry by
// entry: `check_id`, then a floating wire dtype, shape [n, d_model] (n =
// expected_rows[i] when given, any n otherwise) and finite values. Errors are
// InvalidArgument naming the field ("inputs[1].rows contains NaN or Inf").
// Takes the entries' bytes (TakeTensor): the tensors own them, no copy.
// Rows in shared memory are found through `shared` (null: refused) and
// alias it; the caller copies them before the call is answered.
absl::StatusOr<std::vector<at::Tensor>> DecodeRequestRows(
    ExpertRowsList* entries, absl::string_view name, int64_t d_model,
    const ExpertIdCheck& check_id, absl::Span<const int64_t> expected_rows = {},
    SharedMemoryLookup* shared = nullptr);

// Where a call's tensors go: at the next aligned offset of a shared-memory
// slice while they fit, inline after that, and inline without a slice.
class TensorSink {
 public:
  // Inline.
  TensorSink() = default;
  // Client side: `region` (null: inline) from offset 0 on.
  explicit TensorSink(std::shared_ptr<SharedMemoryRegion> region);
  // Server side: a request's output_slice (`slice` null or `shared` null:
  // inline). Errors name `field`.
  static absl::StatusOr<TensorSink> Create(const v1::SharedMemorySlice* slice,
                                           SharedMemoryLookup* shared, absl::string_view field);

  absl::Status Encode(const at::Tensor& tensor, v1::Tensor* out);
  // Client side: names the rest of the region, past the tensors placed so
  // far, as the request's output_slice; sets none when inline (a service
  // with --shared_memory refuses an empty one).
  void NameRest(v1::ExpertForwardRequest* request) const;
  void NameRest(v1::ExpertBackwardRequest* request) const;

 private:
  void NameRest(v1::SharedMemorySlice* slice) const;

  std::shared_ptr<SharedMemoryRegion> region_;
  uint64_t next_ = 0;
  uint64_t end_ = 0;
};

// Client side. Appends rows [begin, end) of a group's expert-sorted rows to
// `out`, one ExpertRows per run of equal expert ids (`experts` is on the CPU).
// The bytes go through `sink` (null: inline).
absl::Status AppendExpertRuns(const at::Tensor& rows, const std::vector<int64_t>& experts,
                              int64_t begin, int64_t end, ExpertRowsList* out,
                              TensorSink* sink = nullptr);

// Client side. Concatenates the rows of `parts` into one [n, d_model] float32
// tensor, checking that part i has as many rows as `expected[i]`. Takes the
// parts' bytes (TakeTensor): a single float32 inline part is returned without
// a copy. Parts in shared memory are found through `shared` and copied out.
absl::StatusOr<at::Tensor> ConcatExpertRows(ExpertRowsList* parts,
                                            const ExpertRowsList& expected, int64_t d_model,
                                            absl::string_view what,
                                            SharedMemoryLookup* shared = nullptr);

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_EXPERT_ROWS_H_
