#include "expert_service/expert_optimizer.h"

#include <cmath>
#include <map>
#include <set>
#include <tuple>
#include <type_traits>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <torch/optim/adamw.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/optimizer_state_key.h"
#include "common/parallel_for.h"
#include "common/squared_norm.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"

namespace himoe::expert {
namespace {

constexpr char kLastAppliedStep[] = "optimizer.last_applied_step";

std::string ShapeString(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

using StateKeyType = std::decay_t<decltype(std::declval<torch::optim::AdamW&>().state())>::key_type;

StateKeyType StateKey(const at::Tensor& param) {
  return OptimizerStateKey<StateKeyType>(param.unsafeGetTensorImpl());
}

absl::Status ValidateOptions(const StepOptions& o) {
  const auto bad = [](const char* field, double value, const char* expected) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", value, "; expected ", expected));
  };
  if (!(o.lr >= 0) || !std::isfinite(o.lr)) return bad("learning_rate", o.lr, "finite >= 0");
  if (!(o.grad_scale >= 0) || !std::isfinite(o.grad_scale)) {
    return bad("grad_scale", o.grad_scale, "finite >= 0");
  }
  if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay)) {
    return bad("weight_decay", o.weight_decay, "finite >= 0");
  }
  if (!(o.beta1 >= 0 && o.beta1 < 1)) return bad("beta1", o.beta1, "in [0, 1)");
  if (!(o.beta2 >= 0 && o.beta2 < 1)) return bad("beta2", o.beta2, "in [0, 1)");
  if (!(o.eps > 0) || !std::isfinite(o.eps)) return bad("eps", o.eps, "finite > 0");
  return absl::OkStatus();
}

// Whether FusedAdamW can update `p`: a float CPU tensor, contiguous, as its
// grad. (CUDA and the rest take torch::optim::AdamW.)
bool FusedAdamWApplies(const at::Tensor& p) {
  const auto plain = [](const at::Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
  };
  return plain(p) && (!p.grad().defined() || plain(p.grad()));
}

// torch::optim::AdamW::step (1.13) for one parameter, in one pass over its
// elements instead of ten tensor ops: the grad scaled by `grad_scale`, then
//   p <- p * (1 - lr * wd);  m <- beta1 m + (1 - beta1) g;
//   v <- beta2 v + (1 - beta2) g^2;
//   p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps),
// each constant rounded to float as the tensor ops round it, and the grad
// zeroed. Equal to torch's AdamW to float rounding (torch fuses some
// multiply-adds). `step` is t, already incremented. Reads and writes p, g,
// m, v once instead of about 25 passes over them.
void FusedAdamW(at::Tensor& p, const at::Tensor& grad, at::Tensor& exp_avg,
                at::Tensor& exp_avg_sq, int64_t step, const torch::optim::AdamWOptions& o,
                double grad_scale) {
  const double lr = o.lr(), wd = o.weight_decay();
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(step));
  // x * 1 is exact, so the decay and scale are multiplied unconditionally.
  const float decay = static_cast<float>(1 - lr * wd);
  const float scale = static_cast<float>(grad_scale);
  const float b1 = static_cast<float>(beta1), one_b1 = static_cast<float>(1 - beta1);
  const float b2 = static_cast<float>(beta2), one_b2 = static_cast<float>(1 - beta2);
  const float root_bc2 = static_cast<float>(std::sqrt(bias_correction2));
  const float eps = static_cast<float>(o.eps());
  const float neg_step = static_cast<float>(-lr / bias_correction1);
  float* pw = p.data_ptr<float>();
  float* gw = grad.data_ptr<float>();
  float* mw = exp_avg.data_ptr<float>();
  float* vw = exp_avg_sq.data_ptr<float>();
  ParallelForRange(0, p.numel(), 1 << 14, at::get_num_threads(), [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#if defined(__SSE2__)
    // Four lanes, the same operations in the same order as the tail below
    // (no fused multiply-add: SSE2 has none).
    const __m128 v_decay = _mm_set1_ps(decay), v_scale = _mm_set1_ps(scale);
    const __m128 v_b1 = _mm_set1_ps(b1), v_one_b1 = _mm_set1_ps(one_b1);
    const __m128 v_b2 = _mm_set1_ps(b2), v_one_b2 = _mm_set1_ps(one_b2);
    const __m128 v_root = _mm_set1_ps(root_bc2), v_eps = _mm_set1_ps(eps);
    const __m128 v_step = _mm_set1_ps(neg_step), zero = _mm_setzero_ps();
    for (; i + 4 <= end; i += 4) {
      const __m128 w = _mm_mul_ps(_mm_loadu_ps(pw + i), v_decay);
      const __m128 g = _mm_mul_ps(_mm_loadu_ps(gw + i), v_scale);
      const __m128 m =
          _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(mw + i), v_b1), _mm_mul_ps(v_one_b1, g));
      const __m128 v = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(vw + i), v_b2),
                                  _mm_mul_ps(_mm_mul_ps(v_one_b2, g), g));
      const __m128 denom = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(v), v_root), v_eps);
      _mm_storeu_ps(pw + i, _mm_add_ps(w, _mm_div_ps(_mm_mul_ps(v_step, m), denom)));
      _mm_storeu_ps(mw + i, m);
      _mm_storeu_ps(vw + i, v);
      _mm_storeu_ps(gw + i, zero);
    }
#endif
    for (; i < end; ++i) {
      const float w = pw[i] * decay;
      const float g = gw[i] * scale;
      const float m = mw[i] * b1 + one_b1 * g;
      const float v = vw[i] * b2 + one_b2 * g * g;
      const float denom = std::sqrt(v) / root_bc2 + eps;
      pw[i] = w + neg_step * m / denom;
      mw[i] = m;
      vw[i] = v;
      gw[i] = 0;
    }
  });
}

}  // namespace

ExpertOptimizer::~ExpertOptimizer() = default;

absl::StatusOr<std::unique_ptr<ExpertOptimizer>> ExpertOptimizer::Create(
    std::vector<ExpertGroup*> groups) {
  if (groups.empty()) {
    return absl::InvalidArgumentError("expert optimizer: no expert groups");
  }
  std::set<int> layers;
  for (const ExpertGroup* g : groups) {
    if (g == nullptr) return absl::InvalidArgumentError("expert optimizer: null group");
    if (!layers.insert(g->layer()).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "expert optimizer: layer ", g->layer(), " appears twice"));
    }
  }
  std::unique_ptr<ExpertOptimizer> opt(new ExpertOptimizer());
  std::vector<at::Tensor> decayed, not_decayed;
  for (const ExpertGroup* g : groups) {
    for (const auto& [name, tensor] : g->named_parameters()) {
      opt->params_.push_back({absl::StrCat("layer", g->layer(), ".", name), tensor});
      (name == "w1" || name == "w2" ? decayed : not_decayed).push_back(tensor);
    }
  }
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    using torch::optim::AdamWOptions;
    std::vector<torch::optim::OptimizerParamGroup> param_groups;
    param_groups.emplace_back(decayed, std::make_unique<AdamWOptions>());
    param_groups.emplace_back(not_decayed,
                              std::make_unique<AdamWOptions>(AdamWOptions().weight_decay(0)));
    opt->adamw_ = std::make_unique<torch::optim::AdamW>(std::move(param_groups));
    return absl::OkStatus();
  }));
  return opt;
}

double ExpertOptimizer::GradNormSquared() const {
  double sum = 0;
  for (const Param& p : params_) {
    const at::Tensor& g = p.tensor.grad();
    if (g.defined()) sum += SquaredNorm(g);
  }
  return sum;
}

absl::StatusOr<OptimizerStepResult> ExpertOptimizer::Step(const StepOptions& o) {
  HIMOE_RETURN_IF_ERROR(ValidateOptions(o));
  OptimizerStepResult result;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    result.grad_norm_squared = GradNormSquared();
    if (o.step <= last_applied_step_) return absl::OkStatus();
    at::NoGradGuard no_grad;
    auto& groups = adamw_->param_groups();
    for (size_t i = 0; i < groups.size(); ++i) {
      auto& options = static_cast<torch::optim::AdamWOptions&>(groups[i].options());
      options.lr(o.lr)
          .betas(std::make_tuple(o.beta1, o.beta2))
          .eps(o.eps)
          .weight_decay(i == 0 ? o.weight_decay : 0.0);
    }
    bool fused = true;
    for (const Param& p : params_) fused = fused && FusedAdamWApplies(p.tensor);
    if (fused) {
      for (auto& group : groups) {
        const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
        for (at::Tensor& p : group.params()) {
          if (!p.grad().defined()) continue;
          auto& slot = adamw_->state()[StateKey(p)];
          if (slot == nullptr) {
            auto fresh = std::make_unique<torch::optim::AdamWParamState>();
            fresh->step(0);
            fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Contiguous));
            fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Contiguous));
            slot = std::move(fresh);
          }
          auto& state = static_cast<torch::optim::AdamWParamState&>(*slot);
          state.exp_avg(state.exp_avg().to(at::kFloat).contiguous());
          state.exp_avg_sq(state.exp_avg_sq().to(at::kFloat).contiguous());
          state.step(state.step() + 1);
          FusedAdamW(p, p.grad(), state.exp_avg(), state.exp_avg_sq(), state.step(), options,
                     o.grad_scale);
        }
      }
    } else {
      if (o.grad_scale != 1.0) {
        for (const Param& p : params_) {
          if (p.tensor.grad().defined()) p.tensor.grad().mul_(o.grad_scale);
        }
      }
      adamw_->step();
      ZeroGrad();
    }
    last_applied_step_ = o.step;
    result.applied = true;
    return absl::OkStatus();
  }));
  result.last_applied_step = last_applied_step_;
  return result;
}

void ExpertOptimizer::Reset() {
  ZeroGrad();
  adamw_->state().clear();
  last_applied_step_ = 0;
}

void ExpertOptimizer::ZeroGrad() {
  for (const Param& p : params_) {
    if (p.tensor.grad().defined()) p.tensor.grad().detach().zero_();
  }
}

const ExpertOptimizer::Param* ExpertOptimizer::FindParam(const std::string& name) const {
  for (const Param& p : params_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::vector<NamedTensor> ExpertOptimizer::State() const {
  std::vector<NamedTensor> out;
  const auto& states = adamw_->state();
  for (const Param& p : params_) {
    const auto it = states.find(StateKey(p.tensor));
    if (it == states.end()) continue;
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    out.emplace_back(p.name + ".exp_avg",
                     s.exp_avg().detach().to(at::kCPU).clone(at::MemoryFormat::Contiguous));
    out.emplace_back(p.name + ".exp_avg_sq",
                     s.exp_avg_sq().detach().to(at::kCPU).clone(at::MemoryFormat::Contiguous));
    out.emplace_back(p.name + ".step", at::scalar_tensor(s.step(), at::kLong));
  }
  out.emplace_back(kLastAppliedStep,
                   at::scalar_tensor(static_cast<int64_t>(last_applied_step_), at::kLong));
  return out;
}

bool ExpertOptimizer::IsStateName(const std::string& name) {
  std::string param, field;
  return absl::StartsWith(name, "optimizer.") || SplitAdamWStateName(name, &param, &field);
}

absl::Status ExpertOptimizer::ValidateStateTensor(const std::string& name,
                                                  c10::ScalarType dtype,
                                                  at::IntArrayRef shape) const {
  std::string param_name, field;
  const Param* param = nullptr;
  const bool scalar = name == kLastAppliedStep ||
                      (SplitAdamWStateName(name, &param_name, &field) && field == "step");
  if (name != kLastAppliedStep) {
    if (!field.empty()) param = FindParam(param_name);
    if (param == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state: unknown optimizer tensor name '", name,
          "'; expected layer<L>.<w1|b1|w2|b2>.<exp_avg|exp_avg_sq|step> of a served "
          "layer, or ", kLastAppliedStep));
    }
  }
  if (scalar) {
    if (dtype != at::kLong || !shape.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "state '", name, "': expected an int64 scalar, got ", c10::toString(dtype), " ",
          ShapeString(shape)));
    }
    return absl::OkStatus();
  }
  if (!param->tensor.sizes().equals(shape)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state '", name, "': shape ", ShapeString(shape), " does not match the parameter's ",
        ShapeString(param->tensor.sizes())));
  }
  if (param->tensor.scalar_type() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state '", name, "': dtype ", c10::toString(dtype), " does not match the parameter's ",
        c10::toString(param->tensor.scalar_type())));
  }
  return absl::OkStatus();
}

absl::Status ExpertOptimizer::SetState(absl::Span<const NamedTensor> tensors) {
  // param name -> field -> tensor
  std::map<std::string, std::map<std::string, at::Tensor>> per_param;
  const at::Tensor* last_applied = nullptr;
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) {
      return absl::InvalidArgumentError(absl::StrCat("state '", name, "': undefined tensor"));
    }
    HIMOE_RETURN_IF_ERROR(ValidateStateTensor(name, tensor.scalar_type(), tensor.sizes()));
    if (name == kLastAppliedStep) {
      if (last_applied != nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("state '", name, "': given twice"));
      }
      last_applied = &tensor;
      continue;
    }
    std::string param, field;
    SplitAdamWStateName(name, &param, &field);
    if (!per_param[param].emplace(field, tensor).second) {
      return absl::InvalidArgumentError(absl::StrCat("state '", name, "': given twice"));
    }
  }
  for (const auto& [param, fields] : per_param) {
    if (fields.size() != 3) {
      std::vector<std::string> missing;
      for (const char* f : kAdamWStateFields) {
        if (fields.count(f) == 0) missing.push_back(f);
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "state '", param, "': optimizer state lacks ", absl::StrJoin(missing, ", "),
          "; exp_avg, exp_avg_sq and step go together"));
    }
  }
  // Build every new entry before touching the optimizer.
  std::vector<std::pair<StateKeyType, std::unique_ptr<torch::optim::AdamWParamState>>> built;
  int64_t last_applied_value = 0;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    if (last_applied != nullptr) last_applied_value = last_applied->item<int64_t>();
    for (const auto& [param_name, fields] : per_param) {
      const int64_t step = fields.at("step").item<int64_t>();
      if (step < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("state '", param_name, ".step': ", step, "; expected >= 0"));
      }
      const at::Tensor& p = FindParam(param_name)->tensor;
      const auto copy = [&](const at::Tensor& t) {
        return t.detach().to(p.device(), p.scalar_type()).clone(at::MemoryFormat::Contiguous);
      };
      auto state = std::make_unique<torch::optim::AdamWParamState>();
      state->step(step);
      state->exp_avg(copy(fields.at("exp_avg")));
      state->exp_avg_sq(copy(fields.at("exp_avg_sq")));
      built.emplace_back(StateKey(p), std::move(state));
    }
    return absl::OkStatus();
  }));
  auto& states = adamw_->state();
  for (auto& [key, state] : built) states[key] = std::move(state);
  if (last_applied != nullptr) last_applied_step_ = static_cast<uint64_t>(last_applied_value);
  return absl::OkStatus();
}

}  // namespace himoe::expert
