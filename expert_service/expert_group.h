#ifndef HIMOE_EXPERT_SERVICE_EXPERT_GROUP_H_
#define HIMOE_EXPERT_SERVICE_EXPERT_GROUP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"

namespace himoe::expert {

struct ExpertGroupOptions {
  int group_id = 0;
  int experts_per_group = 1;  // S
  int64_t d_model = 0;
  int64_t d_ff = 0;
  int layer = 0;
  uint64_t seed = 0;
  c10::Device device = c10::Device(c10::kCPU);
  c10::ScalarType dtype = c10::kFloat;  // kFloat or kBFloat16
};

// The experts [group_id*S, (group_id+1)*S) of one MoE layer on one device.
// Expert e is the FFN  y = W2_e gelu(W1_e x + b1_e) + b2_e  (d -> d_ff -> d).
// Weights of expert e depend only on (seed, layer, e), so a group built in any
// process holds the same experts as the in-process reference.
class ExpertGroup {
 public:
  static absl::StatusOr<std::unique_ptr<ExpertGroup>> Create(
      const ExpertGroupOptions& options);

  // rows [n, d] with global expert ids [n] (all inside this group). Returns
  // [n, d] in the group's dtype, on its device, differentiable w.r.t. the
  // rows and the parameters.
  absl::StatusOr<at::Tensor> Forward(const at::Tensor& rows,
                                     const at::Tensor& expert_ids) const;

  // (name, tensor) of every parameter: "w1" [S, d_ff, d], "b1" [S, d_ff],
  // "w2" [S, d, d_ff], "b2" [S, d].
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  std::vector<at::Tensor> parameters() const;

  const ExpertGroupOptions& options() const { return options_; }
  int first_expert() const { return options_.group_id * options_.experts_per_group; }
  bool owns(int64_t expert_id) const {
    return expert_id >= first_expert() &&
           expert_id < first_expert() + options_.experts_per_group;
  }

 private:
  explicit ExpertGroup(const ExpertGroupOptions& options) : options_(options) {}

  ExpertGroupOptions options_;
  at::Tensor w1_, b1_, w2_, b2_;
};

// The expert FFN on rows of one expert: W2 gelu(W1 x + b1) + b2.
at::Tensor ExpertFfn(const at::Tensor& x, const at::Tensor& w1,
                     const at::Tensor& b1, const at::Tensor& w2,
                     const at::Tensor& b2);

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_EXPERT_GROUP_H_
