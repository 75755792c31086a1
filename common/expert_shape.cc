#include "common/expert_shape.h"

#include <vector>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace himoe {

absl::Status ValidateExpertShape(const v1::ExpertShape& s) {
  const auto invalid = [](absl::string_view field, absl::string_view expected, int64_t got) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert shape: ", field, " must be ", expected, ", got ", got));
  };
  if (s.num_experts() < 1) return invalid("num_experts (N)", ">= 1", s.num_experts());
  if (s.num_groups() < 1) return invalid("num_groups (M)", ">= 1", s.num_groups());
  if (s.num_experts() % s.num_groups() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert shape: num_experts (N=", s.num_experts(), ") must be a multiple of num_groups (M=",
        s.num_groups(), ")"));
  }
  if (s.num_layers() < 1) return invalid("num_layers", ">= 1", s.num_layers());
  if (s.d_model() < 1) return invalid("d_model", ">= 1", s.d_model());
  if (s.d_ff() < 1) return invalid("d_ff", ">= 1", s.d_ff());
  if (s.dtype() != v1::DTYPE_FLOAT32 && s.dtype() != v1::DTYPE_BFLOAT16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert shape: dtype must be float32 or bfloat16, got ", v1::DType_Name(s.dtype())));
  }
  return absl::OkStatus();
}

v1::ExpertShape ExpertShapeFromCluster(const v1::ClusterConfig& cluster) {
  const v1::ModelSpec& m = cluster.model();
  v1::ExpertShape s;
  s.set_num_experts(m.num_experts());
  s.set_num_groups(m.num_groups());
  s.set_num_layers(m.num_layers());
  s.set_d_model(m.d_model());
  s.set_d_ff(m.d_ff());
  s.set_seed(m.seed());
  s.set_dtype(ParseExpertDtype(m.expert_dtype().empty() ? "float32" : m.expert_dtype())
                  .value_or(v1::DTYPE_UNSPECIFIED));
  return s;
}

absl::StatusOr<v1::DType> ParseExpertDtype(absl::string_view name) {
  if (name == "float32") return v1::DTYPE_FLOAT32;
  if (name == "bfloat16") return v1::DTYPE_BFLOAT16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: expected float32 or bfloat16, got '", name, "'"));
}

std::string ExpertDtypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return "float32";
    case v1::DTYPE_BFLOAT16:
      return "bfloat16";
    default:
      return v1::DType_Name(dtype);
  }
}

namespace {

std::string FieldValue(const v1::ExpertShape& s, const google::protobuf::FieldDescriptor* f) {
  const google::protobuf::Reflection* r = s.GetReflection();
  switch (f->cpp_type()) {
    case google::protobuf::FieldDescriptor::CPPTYPE_INT32:
      return absl::StrCat(r->GetInt32(s, f));
    case google::protobuf::FieldDescriptor::CPPTYPE_INT64:
      return absl::StrCat(r->GetInt64(s, f));
    case google::protobuf::FieldDescriptor::CPPTYPE_UINT64:
      return absl::StrCat(r->GetUInt64(s, f));
    case google::protobuf::FieldDescriptor::CPPTYPE_ENUM:
      return ExpertDtypeName(static_cast<v1::DType>(r->GetEnumValue(s, f)));
    default:
      return "?";
  }
}

}  // namespace

absl::Status CheckExpertShape(const v1::ExpertShape& expected, const v1::ExpertShape& served,
                              absl::string_view where) {
  std::vector<std::string> got, want;
  const google::protobuf::Descriptor* d = v1::ExpertShape::descriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* f = d->field(i);
    const std::string a = FieldValue(served, f), b = FieldValue(expected, f);
    if (a == b) continue;
    got.push_back(absl::StrCat(f->name(), " ", a));
    want.push_back(absl::StrCat(f->name(), " ", b));
  }
  if (got.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(where, " serves ", absl::StrJoin(got, ", "),
                                                    "; the model needs ",
                                                    absl::StrJoin(want, ", ")));
}

std::string ExpertShapeDebugString(const v1::ExpertShape& s) {
  return absl::StrCat("N=", s.num_experts(), " M=", s.num_groups(), " layers=", s.num_layers(),
                      " d_model=", s.d_model(), " d_ff=", s.d_ff(), " seed=", s.seed(), " ",
                      ExpertDtypeName(s.dtype()));
}

}  // namespace himoe
