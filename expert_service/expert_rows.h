#ifndef HIMOE_EXPERT_SERVICE_EXPERT_ROWS_H_
#define HIMOE_EXPERT_SERVICE_EXPERT_ROWS_H_

#include <cstdint>
#include <functional>
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

// Server side: where a call's outputs go. With the request's output_slice
// and shared memory on, each output goes at the slice's next aligned offset
// while it fits, and inline after that; inline without either.
class OutputSink {
 public:
  // `slice` null, or `shared` null: inline. Errors name `field`.
  static absl::StatusOr<OutputSink> Create(const v1::SharedMemorySlice* slice,
                                           SharedMemoryLookup* shared, absl::string_view field);
  absl::Status Encode(const at::Tensor& tensor, v1::Tensor* out);

 private:
  std::shared_ptr<SharedMemoryRegion> region_;
  uint64_t next_ = 0;
  uint64_t end_ = 0;
};

// Client side. Appends rows [begin, end) of a group's expert-sorted rows to
// `out`, one ExpertRows per run of equal expert ids (`experts` is on the CPU).
// With `region`, the bytes go into it from *offset on (each run at an
// aligned offset; *offset ends past the last), and gRPC carries references.
absl::Status AppendExpertRuns(const at::Tensor& rows, const std::vector<int64_t>& experts,
                              int64_t begin, int64_t end, ExpertRowsList* out,
                              SharedMemoryRegion* region = nullptr, uint64_t* offset = nullptr);

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
