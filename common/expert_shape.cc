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
  if (s.matmul_dtype() != v1::DTYPE_UNSPECIFIED && s.matmul_dtype() != v1::DTYPE_FLOAT32 &&
      s.matmul_dtype() != v1::DTYPE_BFLOAT16) {
    return absl::InvalidArgumentError(absl::StrCat("expert shape: matmul_dtype must be float32 or ",
                                                   "bfloat16, got ",
                                                   v1::DType_Name(s.matmul_dtype())));
  }
  if (!v1::WeightInit_IsValid(s.init())) return invalid("init", "default or switch", s.init());
  if (s.init() == v1::WEIGHT_INIT_SWITCH && s.n_layer() < 1) {
    return invalid("n_layer", ">= 1 (the transformer's depth) under init switch", s.n_layer());
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
  // An unknown name reads as an invalid enum value, which validation names.
  s.set_init(ParseWeightInit(m.init().empty() ? "default" : m.init())
                 .value_or(static_cast<v1::WeightInit>(-1)));
  s.set_n_layer(m.n_layer());
  if (m.matmul_dtype() == "bfloat16") s.set_matmul_dtype(v1::DTYPE_BFLOAT16);
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

absl::StatusOr<v1::WeightInit> ParseWeightInit(absl::string_view name) {
  if (name == "default") return v1::WEIGHT_INIT_DEFAULT;
  if (name == "switch") return v1::WEIGHT_INIT_SWITCH;
  return absl::InvalidArgumentError(
      absl::StrCat("init: expected default or switch, got '", name, "'"));
}

std::string WeightInitName(v1::WeightInit init) {
  switch (init) {
    case v1::WEIGHT_INIT_DEFAULT:
      return "default";
    case v1::WEIGHT_INIT_SWITCH:
      return "switch";
    default:
      return absl::StrCat(static_cast<int>(init));
  }
}

absl::StatusOr<v1::ExpertShape> ExpertShapeFromFlags(const ExpertShapeFlags& flags) {
  v1::ExpertShape shape;
  shape.set_num_experts(flags.num_experts);
  shape.set_num_groups(flags.num_groups);
  shape.set_num_layers(flags.num_layers);
  shape.set_d_model(flags.d_model);
  shape.set_d_ff(flags.d_ff);
  shape.set_seed(flags.seed);
  // The parsers' messages begin with "dtype: " and "init: ".
  const auto flag_error = [](absl::string_view prefix, const absl::Status& status) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, status.message()));
  };
  const absl::StatusOr<v1::DType> dtype = ParseExpertDtype(flags.dtype);
  if (!dtype.ok()) return flag_error("--", dtype.status());
  shape.set_dtype(*dtype);
  const absl::StatusOr<v1::DType> matmul = ParseExpertDtype(flags.matmul_dtype);
  if (!matmul.ok()) return flag_error("--matmul_", matmul.status());
  if (*matmul == v1::DTYPE_BFLOAT16) shape.set_matmul_dtype(*matmul);
  const absl::StatusOr<v1::WeightInit> init = ParseWeightInit(flags.init);
  if (!init.ok()) return flag_error("--", init.status());
  shape.set_init(*init);
  shape.set_n_layer(flags.n_layer);
  return shape;
}

std::vector<std::string> ExpertShapeArgs(const v1::ExpertShape& s) {
  std::vector<std::string> args = {
      absl::StrCat("--num_groups=", s.num_groups()),
      absl::StrCat("--num_experts=", s.num_experts()),
      absl::StrCat("--num_layers=", s.num_layers()),
      absl::StrCat("--d_model=", s.d_model()),
      absl::StrCat("--d_ff=", s.d_ff()),
      absl::StrCat("--seed=", s.seed()),
      absl::StrCat("--dtype=", ExpertDtypeName(s.dtype())),
  };
  if (s.matmul_dtype() == v1::DTYPE_BFLOAT16) args.push_back("--matmul_dtype=bfloat16");
  if (s.init() != v1::WEIGHT_INIT_DEFAULT) {
    args.push_back(absl::StrCat("--init=", WeightInitName(s.init())));
    args.push_back(absl::StrCat("--n_layer=", s.n_layer()));
  }
  return args;
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
      if (f->enum_type() == v1::WeightInit_descriptor()) {
        return WeightInitName(static_cast<v1::WeightInit>(r->GetEnumValue(s, f)));
      }
      if (f->number() == v1::ExpertShape::kMatmulDtypeFieldNumber &&
          r->GetEnumValue(s, f) == v1::DTYPE_UNSPECIFIED) {
        return "float32";  // unset: the products in the weights' dtype
      }
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
                      ExpertDtypeName(s.dtype()),
                      s.matmul_dtype() == v1::DTYPE_BFLOAT16 ? " matmul=bfloat16" : "",
                      s.init() == v1::WEIGHT_INIT_DEFAULT
                          ? ""
                          : absl::StrCat(" init=", WeightInitName(s.init()), " n_layer=",
                                         s.n_layer()));
}

}  // namespace himoe
