#include "expert_service/expert_group.h"

#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <torch/types.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/expert_shape.h"
#include "common/linear.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "common/torch_runtime.h"

namespace himoe::expert {
namespace {

// A distinct, stable seed per (seed, layer, expert).
uint64_t ExpertSeed(uint64_t seed, int layer, int64_t expert) {
  uint64_t h = seed ^ 0x9E3779B97F4A7C15ull;
  for (const uint64_t v : {static_cast<uint64_t>(layer), static_cast<uint64_t>(expert)}) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h *= 0xBF58476D1CE4E5B9ull;
  }
  return h;
}

// nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
at::Tensor Uniform(at::IntArrayRef shape, int64_t fan_in, at::Generator& gen) {
  const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
  return at::empty(shape, at::dtype(at::kFloat)).uniform_(-bound, bound, gen);
}

}  // namespace

at::Tensor ExpertFfn(const at::Tensor& x, const at::Tensor& w1,
                     const at::Tensor& b1, const at::Tensor& w2,
                     const at::Tensor& b2) {
  return Linear(at::gelu(Linear(x, w1, b1)), w2, b2);
}

absl::StatusOr<std::unique_ptr<ExpertGroup>> ExpertGroup::Create(const v1::ExpertShape& shape,
                                                                 int group_id, int layer,
                                                                 c10::Device device) {
  HIMOE_RETURN_IF_ERROR(ValidateExpertShape(shape));
  if (group_id < 0 || group_id >= shape.num_groups()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "group_id: ", group_id, " is outside [0, ", shape.num_groups(), ")"));
  }
  if (layer < 0 || layer >= shape.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert group: layer ", layer, " is outside [0, ", shape.num_layers(), ")"));
  }
  HIMOE_ASSIGN_OR_RETURN(const c10::ScalarType dtype, ScalarTypeFromProto(shape.dtype()));
  std::unique_ptr<ExpertGroup> group(new ExpertGroup(shape, group_id, layer, device, dtype));
  const int64_t d = shape.d_model(), d_ff = shape.d_ff();
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    std::vector<at::Tensor> w1, b1, w2, b2;
    for (int s = 0; s < group->experts_per_group(); ++s) {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(
          ExpertSeed(shape.seed(), layer, group->first_expert() + s));
      w1.push_back(Uniform({d_ff, d}, d, gen));
      b1.push_back(Uniform({d_ff}, d, gen));
      w2.push_back(Uniform({d, d_ff}, d_ff, gen));
      b2.push_back(Uniform({d}, d_ff, gen));
    }
    const auto place = [&](const std::vector<at::Tensor>& parts) {
      return at::stack(parts).to(device, dtype).set_requires_grad(true);
    };
    group->w1_ = place(w1);
    group->b1_ = place(b1);
    group->w2_ = place(w2);
    group->b2_ = place(b2);
    return absl::OkStatus();
  }));
  return group;
}

absl::StatusOr<at::Tensor> ExpertGroup::Forward(const at::Tensor& rows,
                                                const at::Tensor& expert_ids) const {
  if (rows.dim() != 2 || rows.size(1) != d_model()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert group ", group_id_, ": rows must be [n, d_model=",
        d_model(), "], got [", absl::StrJoin(rows.sizes(), ", "), "]"));
  }
  if (expert_ids.dim() != 1 || expert_ids.size(0) != rows.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expert group ", group_id_, ": expert_ids must be [n=", rows.size(0),
        "], got [", absl::StrJoin(expert_ids.sizes(), ", "), "]"));
  }
  at::Tensor out;
  if (device_.is_cpu() && rows.size(0) > 0 && rows.size(0) < RowwiseLinearRows()) {
    return ForwardFewRows(rows, expert_ids);
  }
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    const at::Tensor local =
        (expert_ids.to(device_, at::kLong) - first_expert());
    const int s_count = experts_per_group();
    if (local.numel() > 0 &&
        (local.min().item<int64_t>() < 0 || local.max().item<int64_t>() >= s_count)) {
      return IdsOutsideGroupError();
    }
    const at::Tensor x = rows.to(device_, dtype_);
    out = at::zeros({rows.size(0), d_model()}, x.options());
    for (int64_t s = 0; s < s_count; ++s) {
      const at::Tensor idx = at::nonzero(local.eq(s)).reshape(-1);
      if (idx.numel() == 0) continue;
      const at::Tensor y = ExpertFfn(x.index_select(0, idx), w1_[s], b1_[s], w2_[s], b2_[s]);
      out = out.index_copy(0, idx, y);
    }
    return absl::OkStatus();
  }));
  return out;
}

absl::Status ExpertGroup::IdsOutsideGroupError() const {
  return absl::InvalidArgumentError(absl::StrCat("expert group ", group_id_,
                                                 ": expert ids must be in [", first_expert(),
                                                 ", ", first_expert() + experts_per_group(), ")"));
}

absl::StatusOr<at::Tensor> ExpertGroup::ForwardFewRows(const at::Tensor& rows,
                                                       const at::Tensor& expert_ids) const {
  at::Tensor out;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    const at::Tensor ids = expert_ids.to(at::kCPU, at::kLong).contiguous();
    const int64_t* id = ids.data_ptr<int64_t>();
    const at::Tensor x = rows.to(device_, dtype_);
    std::vector<at::Tensor> ys;
    for (int64_t i = 0; i < x.size(0); ++i) {
      const int64_t s = id[i] - first_expert();
      if (s < 0 || s >= experts_per_group()) return IdsOutsideGroupError();
      ys.push_back(ExpertFfn(x.narrow(0, i, 1), w1_[s], b1_[s], w2_[s], b2_[s]));
    }
    out = at::cat(ys);
    return absl::OkStatus();
  }));
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> ExpertGroup::named_parameters() const {
  return {{"w1", w1_}, {"b1", b1_}, {"w2", w2_}, {"b2", b2_}};
}

std::vector<at::Tensor> ExpertGroup::parameters() const {
  return {w1_, b1_, w2_, b2_};
}

}  // namespace himoe::expert
