#ifndef HIMOE_COMMON_EXPERT_SHAPE_H_
#define HIMOE_COMMON_EXPERT_SHAPE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "himoe/v1/cluster.pb.h"
#include "himoe/v1/model.pb.h"

namespace himoe {

// The one place that knows which values an ExpertShape may hold.
// InvalidArgument naming the field: N, M >= 1, M divides N, num_layers,
// d_model, d_ff >= 1, dtype FLOAT32 or BFLOAT16, matmul_dtype unset, FLOAT32
// or BFLOAT16, n_layer >= 1 under WEIGHT_INIT_SWITCH.
absl::Status ValidateExpertShape(const v1::ExpertShape& shape);

// The cluster file's model section as an ExpertShape (not validated).
v1::ExpertShape ExpertShapeFromCluster(const v1::ClusterConfig& cluster);

// "float32" / "bfloat16" (the flags' and the cluster file's spelling).
absl::StatusOr<v1::DType> ParseExpertDtype(absl::string_view name);
std::string ExpertDtypeName(v1::DType dtype);

// "default" / "switch" (the flags' and the cluster file's spelling).
absl::StatusOr<v1::WeightInit> ParseWeightInit(absl::string_view name);
std::string WeightInitName(v1::WeightInit init);

// The Info handshake: OK when `served` (what a service says it holds) equals
// `expected`; else FailedPrecondition naming every field that differs,
// "<where> serves seed 7, dtype bfloat16; the model needs seed 1, dtype float32".
absl::Status CheckExpertShape(const v1::ExpertShape& expected, const v1::ExpertShape& served,
                              absl::string_view where);

// The himoe-expert flags that carry an ExpertShape, as read from them.
struct ExpertShapeFlags {
  int num_experts = 8;
  int num_groups = 1;
  int num_layers = 1;
  int64_t d_model = 64;
  int64_t d_ff = 256;
  uint64_t seed = 0;
  std::string dtype = "float32";
  std::string matmul_dtype = "float32";
  std::string init = "default";
  int n_layer = 0;
};

// The shape the flags give (not validated); InvalidArgument naming the flag
// of a dtype or init it does not know ("--matmul_dtype: expected ...").
absl::StatusOr<v1::ExpertShape> ExpertShapeFromFlags(const ExpertShapeFlags& flags);

// The flags that give himoe-expert `shape`: --num_groups, --num_experts,
// --num_layers, --d_model, --d_ff, --seed, --dtype, then --matmul_dtype with
// bf16 products and --init, --n_layer under WEIGHT_INIT_SWITCH.
// ExpertShapeFromFlags of them gives `shape` back (n_layer only under
// WEIGHT_INIT_SWITCH).
std::vector<std::string> ExpertShapeArgs(const v1::ExpertShape& shape);

// "N=8 M=4 layers=2 d_model=64 d_ff=256 seed=0 float32", then " matmul=bfloat16"
// with bf16 products and " init=switch n_layer=4" under WEIGHT_INIT_SWITCH.
std::string ExpertShapeDebugString(const v1::ExpertShape& shape);

}  // namespace himoe

#endif  // HIMOE_COMMON_EXPERT_SHAPE_H_
