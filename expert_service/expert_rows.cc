#include "expert_service/expert_rows.h"

#include <cmath>
#include <utility>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/all_finite.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "common/torch_runtime.h"

namespace himoe::expert {
namespace {

bool IsFloatingWireType(c10::ScalarType type) {
  return type == c10::kFloat || type == c10::kBFloat16 || type == c10::kHalf;
}

int64_t PayloadBytes(const v1::Tensor& t) {
  return static_cast<int64_t>(t.data().size() + t.shared().byte_size());
}

int64_t PayloadBytes(const ExpertRowsList& entries) {
  int64_t total = 0;
  for (const v1::ExpertRows& e : entries) total += PayloadBytes(e.rows());
  return total;
}

}  // namespace

absl::StatusOr<at::Tensor> DecodeRowTensor(v1::Tensor* proto, const std::string& field,
                                           int64_t d_model, int64_t expected_rows,
                                           SharedMemoryLookup* shared) {
  HIMOE_ASSIGN_OR_RETURN(at::Tensor x, TakeTensor(proto, field, shared));
  if (!IsFloatingWireType(x.scalar_type())) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype: ", c10::toString(x.scalar_type()),
                     " is not a floating type; expected FLOAT32 or BFLOAT16"));
  }
  const bool any_rows = expected_rows < 0;
  if (x.dim() != 2 || x.size(1) != d_model || (!any_rows && x.size(0) != expected_rows)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": expected shape ",
        any_rows ? absl::StrCat("[n, ", d_model, "] (2-D, d_model=", d_model, ")")
                 : absl::StrCat("[", expected_rows, ", ", d_model, "] (the saved output's)"),
        ", got ", ShapeString(x.sizes())));
  }
  bool finite = true;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    finite = AllFinite(x);
    return absl::OkStatus();
  }));
  if (!finite) return absl::InvalidArgumentError(absl::StrCat(field, " contains NaN or Inf"));
  return x;
}

absl::StatusOr<DecodedTokens> DecodeTokenAssignments(v1::TokenAssignments* tokens,
                                                     absl::string_view name, int64_t d_model,
                                                     int32_t first_expert, int32_t end_expert,
                                                     SharedMemoryLookup* shared) {
  const int n = tokens->row_size();
  if (n == 0 || tokens->expert_id_size() != n || tokens->weight_size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": ", n, " rows, ", tokens->expert_id_size(), " expert ids, ", tokens->weight_size(),
        " weights; expected one of each per assignment, at least one"));
  }
  DecodedTokens out;
  HIMOE_ASSIGN_OR_RETURN(
      out.rows,
      DecodeRowTensor(tokens->mutable_rows(), absl::StrCat(name, ".rows"), d_model, -1, shared));
  const int64_t u = out.rows.size(0);
  for (int i = 0; i < n; ++i) {
    const int32_t row = tokens->row(i), id = tokens->expert_id(i);
    if (row < 0 || row >= u) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".row[", i, "]: ", row, "; expected a row of rows, in [0, ", u, ")"));
    }
    if (id < first_expert || id >= end_expert) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".expert_id[", i, "]: ", id, " is outside this group; expected an ",
                       "expert id in [", first_expert, ", ", end_expert, ")"));
    }
    if (i > 0 && id < tokens->expert_id(i - 1)) {
      return absl::InvalidArgumentError(absl::StrCat(name, ".expert_id[", i, "]: ", id, " after ",
                                                     tokens->expert_id(i - 1),
                                                     "; expected ascending expert ids"));
    }
    if (!std::isfinite(tokens->weight(i))) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".weight[", i, "]: ", tokens->weight(i), "; expected finite"));
    }
  }
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    out.assignment_rows = at::empty({n}, at::kLong);
    out.expert_ids = at::empty({n}, at::kLong);
    out.weights = at::empty({n}, at::kFloat);
    int64_t* rows = out.assignment_rows.data_ptr<int64_t>();
    int64_t* ids = out.expert_ids.data_ptr<int64_t>();
    float* weights = out.weights.data_ptr<float>();
    for (int i = 0; i < n; ++i) {
      rows[i] = tokens->row(i);
      ids[i] = tokens->expert_id(i);
      weights[i] = tokens->weight(i);
    }
    return absl::OkStatus();
  }));
  return out;
}

int64_t RowBytes(const v1::ExpertForwardRequest& m) {
  return PayloadBytes(m.inputs()) + PayloadBytes(m.tokens().rows());
}
int64_t RowBytes(const v1::ExpertForwardResponse& m) {
  return PayloadBytes(m.outputs()) + PayloadBytes(m.combined());
}
int64_t RowBytes(const v1::ExpertBackwardRequest& m) {
  return PayloadBytes(m.output_grads()) + PayloadBytes(m.combined_grad());
}
int64_t RowBytes(const v1::ExpertBackwardResponse& m) {
  return PayloadBytes(m.input_grads()) + PayloadBytes(m.token_grads());
}

absl::StatusOr<at::Tensor> TakeAnswerRows(v1::Tensor* proto, int64_t rows, int64_t d_model,
                                          absl::string_view what, SharedMemoryLookup* shared) {
  const bool aliased = proto->has_shared();
  HIMOE_ASSIGN_OR_RETURN(at::Tensor y, TakeTensor(proto, what, shared));
  if (y.dim() != 2 || y.size(0) != rows || y.size(1) != d_model) {
    return absl::InternalError(
        absl::StrCat(what, ": ", ShapeString(y.sizes()), "; expected [", rows, ", ", d_model, "]"));
  }
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    const bool was_float = y.scalar_type() == at::kFloat;
    y = y.to(at::kFloat);
    if (aliased && was_float) y = y.clone();  // the next call writes the region again
    return absl::OkStatus();
  }));
  return y;
}

std::string ShapeString(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::StatusOr<std::vector<at::Tensor>> DecodeRequestRows(
    ExpertRowsList* entries, absl::string_view name, int64_t d_model,
    const ExpertIdCheck& check_id, absl::Span<const int64_t> expected_rows,
    SharedMemoryLookup* shared) {
  std::vector<at::Tensor> rows(entries->size());
  for (int i = 0; i < entries->size(); ++i) {
    v1::ExpertRows* entry = entries->Mutable(i);
    const std::string field = absl::StrCat(name, "[", i, "]");
    HIMOE_RETURN_IF_ERROR(check_id(i, field, entry->expert_id()));
    const int64_t n = i < static_cast<int>(expected_rows.size()) ? expected_rows[i] : -1;
    HIMOE_ASSIGN_OR_RETURN(
        rows[i], DecodeRowTensor(entry->mutable_rows(), field + ".rows", d_model, n, shared));
  }
  return rows;
}

TensorSink::TensorSink(std::shared_ptr<SharedMemoryRegion> region)
    : region_(std::move(region)), end_(region_ == nullptr ? 0 : region_->size()) {}

absl::StatusOr<TensorSink> TensorSink::Create(const v1::SharedMemorySlice* slice,
                                              SharedMemoryLookup* shared,
                                              absl::string_view field) {
  TensorSink sink;
  if (slice == nullptr || shared == nullptr) return sink;
  HIMOE_ASSIGN_OR_RETURN(sink.region_, shared->Find(slice->region(), slice->key(), field));
  HIMOE_RETURN_IF_ERROR(
      sink.region_->Slice(slice->offset(), slice->byte_size(), field).status());
  sink.next_ = slice->offset();
  sink.end_ = slice->offset() + slice->byte_size();
  return sink;
}

absl::Status TensorSink::Encode(const at::Tensor& tensor, v1::Tensor* out) {
  const uint64_t bytes = static_cast<uint64_t>(tensor.numel()) * tensor.element_size();
  if (region_ == nullptr || next_ > end_ || bytes > end_ - next_) return EncodeTensor(tensor, out);
  HIMOE_RETURN_IF_ERROR(EncodeTensorShared(tensor, *region_, next_, out));
  next_ = AlignSharedOffset(next_ + bytes);
  return absl::OkStatus();
}

void TensorSink::NameRest(v1::ExpertForwardRequest* request) const {
  if (region_ != nullptr) NameRest(request->mutable_output_slice());
}

void TensorSink::NameRest(v1::ExpertBackwardRequest* request) const {
  if (region_ != nullptr) NameRest(request->mutable_output_slice());
}

void TensorSink::NameRest(v1::SharedMemorySlice* slice) const {
  slice->set_region(region_->name());
  slice->set_key(region_->key());
  slice->set_offset(next_);
  slice->set_byte_size(end_ > next_ ? end_ - next_ : 0);
}

absl::Status AppendExpertRuns(const at::Tensor& rows, const std::vector<int64_t>& experts,
                              int64_t begin, int64_t end, ExpertRowsList* out,
                              TensorSink* sink) {
  TensorSink inline_sink;
  if (sink == nullptr) sink = &inline_sink;
  int64_t run = begin;
  for (int64_t i = begin + 1; i <= end; ++i) {
    if (i < end && experts[i] == experts[run]) continue;
    v1::ExpertRows* er = out->Add();
    er->set_expert_id(static_cast<int32_t>(experts[run]));
    HIMOE_RETURN_IF_ERROR(sink->Encode(rows.slice(0, run, i), er->mutable_rows()));
    run = i;
  }
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> ConcatExpertRows(ExpertRowsList* parts,
                                            const ExpertRowsList& expected, int64_t d_model,
                                            absl::string_view what,
                                            SharedMemoryLookup* shared) {
  if (parts->size() != expected.size()) {
    return absl::InternalError(absl::StrCat(what, ": ", parts->size(), " row blocks for ",
                                            expected.size(), " sent"));
  }
  std::vector<at::Tensor> pieces;
  bool aliased = false;  // a piece lies in shared memory the next call writes
  for (int i = 0; i < parts->size(); ++i) {
    aliased = aliased || parts->Get(i).rows().has_shared();
    HIMOE_ASSIGN_OR_RETURN(at::Tensor y,
                           TakeTensor(parts->Mutable(i)->mutable_rows(), what, shared));
    if (y.dim() != 2 || y.size(0) != expected.Get(i).rows().shape(0) || y.size(1) != d_model) {
      return absl::InternalError(absl::StrCat(what, ": block ", i, " has the wrong shape"));
    }
    pieces.push_back(std::move(y));
  }
  at::Tensor out;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    if (pieces.empty()) {
      out = at::zeros({0, d_model});
    } else {
      out = (pieces.size() == 1 ? pieces[0] : at::cat(pieces)).to(at::kFloat);
      // One float32 piece comes back as itself.
      if (aliased && pieces.size() == 1 && out.scalar_type() == pieces[0].scalar_type()) {
        out = out.clone();
      }
    }
    return absl::OkStatus();
  }));
  return out;
}

}  // namespace himoe::expert
