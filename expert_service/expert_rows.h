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

// Decodes one tensor of rows on the service side (`field` names it, e.g.
// "combined_grad"): a floating wire dtype, shape [n, d_model] (n =
// expected_rows when >= 0), finite values; takes the bytes like
// DecodeRequestRows.
absl::StatusOr<at::Tensor> DecodeRowTensor(v1::Tensor* proto, const std::string& field,
                                           int64_t d_model, int64_t expected_rows,
                                           SharedMemoryLookup* shared = nullptr);

// A Forward's TokenAssignments, decoded: the rows, and per assignment its row,
// expert id (int64) and weight (float32), on the CPU.
struct DecodedTokens {
  at::Tensor rows;
  at::Tensor assignment_rows;
  at::Tensor expert_ids;
  at::Tensor weights;
};

// Service side: decodes and checks `tokens` (named `name`): the rows as
// DecodeRowTensor, then per assignment a row in [0, u), an expert id in
// [first_expert, end_expert), ascending, and a finite weight.
absl::StatusOr<DecodedTokens> DecodeTokenAssignments(v1::TokenAssignments* tokens,
                                                     absl::string_view name, int64_t d_model,
                                                     int32_t first_expert, int32_t end_expert,
                                                     SharedMemoryLookup* shared = nullptr);

// The bytes of a message's rows, outputs or gradients (Tensor payloads,
// inline or in shared memory); what a call moves, without its framing and
// the per-assignment ids and weights.
int64_t RowBytes(const v1::ExpertForwardRequest& message);
int64_t RowBytes(const v1::ExpertForwardResponse& message);
int64_t RowBytes(const v1::ExpertBackwardRequest& message);
int64_t RowBytes(const v1::ExpertBackwardResponse& message);

// Client side: an answer's [rows, d_model] tensor as float32, taking its bytes
// (copied out of shared memory, which the next call writes again).
absl::StatusOr<at::Tensor> TakeAnswerRows(v1::Tensor* proto, int64_t rows, int64_t d_model,
                                          absl::string_view what,
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
