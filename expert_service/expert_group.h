#ifndef HIMOE_EXPERT_SERVICE_EXPERT_GROUP_H_
#define HIMOE_EXPERT_SERVICE_EXPERT_GROUP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "himoe/v1/model.pb.h"

namespace himoe::expert {

// The experts [g*S, (g+1)*S) of one MoE layer on one device, S = N/M.
// Expert e is the FFN  y = W2_e gelu(W1_e x + b1_e) + b2_e  (d -> d_ff -> d).
// Weights of expert e depend only on (shape.seed, layer, e) and the shape's
// init (v1::WeightInit): every process that builds a group from the same
// shape holds the same experts.
class ExpertGroup {
 public:
  // The one way to build experts. InvalidArgument for an invalid shape
  // (ValidateExpertShape), a group outside [0, M) or a layer outside
  // [0, num_layers).
  static absl::StatusOr<std::unique_ptr<ExpertGroup>> Create(const v1::ExpertShape& shape,
                                                             int group_id, int layer,
                                                             c10::Device device);

  // rows [n, d] with global expert ids [n] (all inside this group). Returns
  // [n, d] in the group's dtype, on its device, differentiable w.r.t. the
  // rows and the parameters.
  absl::StatusOr<at::Tensor> Forward(const at::Tensor& rows,
                                     const at::Tensor& expert_ids) const;
  // Each row once: `rows` [u, d] and, per assignment, its row
  // (`assignment_rows`, int64 [n] in [0, u)), expert (`expert_ids`, [n],
  // ascending) and `weights` (float [n]). Returns float32 [u, d] on the
  // group's device: a row's sum of weight * expert(row) over its
  // assignments, in their order. Differentiable w.r.t. the rows, the weights
  // and the parameters.
  absl::StatusOr<at::Tensor> CombinedForward(const at::Tensor& rows,
                                             const at::Tensor& assignment_rows,
                                             const at::Tensor& expert_ids,
                                             const at::Tensor& weights) const;

  // (name, tensor) of every parameter: "w1" [S, d_ff, d], "b1" [S, d_ff],
  // "w2" [S, d, d_ff], "b2" [S, d].
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  std::vector<at::Tensor> parameters() const;

  const v1::ExpertShape& shape() const { return shape_; }
  int group_id() const { return group_id_; }
  int layer() const { return layer_; }
  c10::Device device() const { return device_; }
  c10::ScalarType dtype() const { return dtype_; }
  // Float32 experts whose products take bfloat16-rounded operands
  // (shape.matmul_dtype, MatmulBf16Out in common/matmul.h).
  bool matmul_bf16() const {
    return dtype_ == c10::kFloat && shape_.matmul_dtype() == v1::DTYPE_BFLOAT16;
  }
  int64_t d_model() const { return shape_.d_model(); }
  int experts_per_group() const { return shape_.num_experts() / shape_.num_groups(); }
  int first_expert() const { return group_id_ * experts_per_group(); }
  bool owns(int64_t expert_id) const {
    return expert_id >= first_expert() && expert_id < first_expert() + experts_per_group();
  }

 private:
  ExpertGroup(const v1::ExpertShape& shape, int group_id, int layer, c10::Device device,
              c10::ScalarType dtype)
      : shape_(shape), group_id_(group_id), layer_(layer), device_(device), dtype_(dtype) {}

  v1::ExpertShape shape_;
  int group_id_;
  int layer_;
  c10::Device device_;
  c10::ScalarType dtype_;
  // Forward of fewer than RowwiseLinearRows() rows on the CPU (decoding): an
  // expert at a time on its rows (Linear's small products), a handful of
  // LibTorch ops per expert where the general path spends a dozen.
  absl::StatusOr<at::Tensor> ForwardFewRows(const at::Tensor& rows,
                                            const at::Tensor& expert_ids) const;
  // InvalidArgument: an expert id outside [first_expert, first_expert + S).
  absl::Status IdsOutsideGroupError() const;

  at::Tensor w1_, b1_, w2_, b2_;
};

// Weight-gradient work an experts' backward left for later: each entry
// computes one backward's weight gradients and adds them to the parameters'
// grads. Run in order (the grads then sum as they would have).
using DeferredWeightGrads = std::vector<std::function<void()>>;

// While alive, the experts' backward on this thread computes the rows'
// gradient only and appends its weight gradients to `sink` (null: computes
// them at once, the default), so that a service can answer Backward with
// the rows' gradient and compute the weight gradients after it. Scopes nest.
class DeferWeightGradsScope {
 public:
  explicit DeferWeightGradsScope(DeferredWeightGrads* sink);
  ~DeferWeightGradsScope();
  DeferWeightGradsScope(const DeferWeightGradsScope&) = delete;
  DeferWeightGradsScope& operator=(const DeferWeightGradsScope&) = delete;

 private:
  DeferredWeightGrads* previous_;
};

// A run of one expert's rows within the rows sorted by expert: local expert
// `expert` owns rows [begin, begin + count); `whole` when that is all of
// its rows.
struct RowPiece {
  int64_t expert = 0;
  int64_t begin = 0;
  int64_t count = 0;
  bool whole = true;
  bool operator==(const RowPiece& o) const {
    return expert == o.expert && begin == o.begin && count == o.count && whole == o.whole;
  }
};

// Splits rows sorted by expert (counts[s] rows of local expert s) into
// `chunks` contiguous chunks of near-equal rows, one per thread, so that the
// threads finish together however uneven the routing is. A cut inside an
// expert's rows moves to the nearer end of them when it would leave a piece
// of fewer than `min_rows` rows there. Experts without rows get no piece.
// The min_rows GroupedExpertFfn plans with: a product of a few rows costs
// BLIS most of a full one (it packs the whole weight).
inline constexpr int64_t kMinRowPiece = 32;
std::vector<std::vector<RowPiece>> PlanRowChunks(const std::vector<int64_t>& counts,
                                                 int chunks, int64_t min_rows);

// The expert FFN on rows of one expert: W2 gelu(W1 x + b1) + b2. Without
// autograd recording, through GeluOut (common/gelu.h), as GroupedExpertFfn.
at::Tensor ExpertFfn(const at::Tensor& x, const at::Tensor& w1,
                     const at::Tensor& b1, const at::Tensor& w2,
                     const at::Tensor& b2);

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_EXPERT_GROUP_H_
