#ifndef HIMOE_EXPERT_SERVICE_EXPERT_OPTIMIZER_H_
#define HIMOE_EXPERT_SERVICE_EXPERT_OPTIMIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/named_tensor.h"
#include "expert_service/expert_group.h"

namespace torch::optim {
class AdamW;
}  // namespace torch::optim

namespace himoe::expert {

// One AdamW update, as the coordinator asks for it.
struct StepOptions {
  uint64_t step = 0;         // applied only if > last_applied_step
  double lr = 1e-3;          // >= 0
  double grad_scale = 1.0;   // global clip scale, finite, >= 0
  double weight_decay = 0;   // decoupled; on w1, w2 only; >= 0
  double beta1 = 0.9;        // [0, 1)
  double beta2 = 0.999;      // [0, 1)
  double eps = 1e-8;         // > 0
};

struct OptimizerStepResult {
  bool applied = false;
  uint64_t last_applied_step = 0;
  // sum ||grad||^2 before grad_scale (of the grads still held if not applied).
  double grad_norm_squared = 0;
};

// AdamW over the experts of one group (all its layers): parameter group 0 is
// every w1, w2 (decayed), group 1 every b1, b2 (never decayed). Used by the
// expert service and by the trainer's in-process mode, so both apply the same
// update. Not thread-safe: the caller excludes Forward/Backward during Step.
//
// Gradients: Step multiplies them by grad_scale, updates, then zeroes them in
// place (they stay defined, as torch 1.13's Optimizer::zero_grad does). AdamW
// skips a parameter whose grad was never defined (no Backward reached it yet).
class ExpertOptimizer {
 public:
  // `groups` (not owned, must outlive this) have distinct layers.
  static absl::StatusOr<std::unique_ptr<ExpertOptimizer>> Create(
      std::vector<ExpertGroup*> groups);
  ~ExpertOptimizer();
  ExpertOptimizer(const ExpertOptimizer&) = delete;
  ExpertOptimizer& operator=(const ExpertOptimizer&) = delete;

  // Sum over all parameters of ||grad||^2 (0 where there is no grad), in double.
  double GradNormSquared() const;

  // Idempotent per step id: a step <= last_applied_step() changes nothing
  // (not even the grads) and returns applied = false.
  absl::StatusOr<OptimizerStepResult> Step(const StepOptions& options);

  // Zeroes every defined grad in place.
  void ZeroGrad();

  // Forgets every AdamW moment and step count, zeroes the grads, and sets
  // last_applied_step to 0: the optimizer as Create left it.
  void Reset();

  uint64_t last_applied_step() const { return last_applied_step_; }

  // CPU copies: "layer<L>.<w1|b1|w2|b2>.<exp_avg|exp_avg_sq|step>" for each
  // parameter that has AdamW state ("step" is an int64 scalar), then
  // "optimizer.last_applied_step" (int64 scalar holding the uint64 bits).
  std::vector<NamedTensor> State() const;

  // Restores tensors named as in State(); validates all first (names, shapes,
  // dtypes, each parameter's three entries together), then applies: all or
  // nothing. Parameters not named keep their state; so does last_applied_step
  // when "optimizer.last_applied_step" is absent.
  absl::Status SetState(absl::Span<const NamedTensor> tensors);

  // Whether `name` has the form of an optimizer state name (known or not).
  static bool IsStateName(const std::string& name);
  // OK if `name` is a state entry of this optimizer with this dtype and shape.
  absl::Status ValidateStateTensor(const std::string& name, c10::ScalarType dtype,
                                   at::IntArrayRef shape) const;

 private:
  struct Param {
    std::string name;  // "layer<L>.<w1|b1|w2|b2>"
    at::Tensor tensor;
  };

  ExpertOptimizer() = default;
  const Param* FindParam(const std::string& name) const;

  std::vector<Param> params_;  // layer order, then w1, b1, w2, b2
  std::unique_ptr<torch::optim::AdamW> adamw_;
  uint64_t last_applied_step_ = 0;
};

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_EXPERT_OPTIMIZER_H_
