#include "model/generator.h"

#include <limits>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"

namespace himoe::model {

absl::StatusOr<std::unique_ptr<Generator>> Generator::Create(const CheckpointContents& contents,
                                                             MoELayers* moe,
                                                             const GeneratorOptions& options) {
  if (options.max_new_tokens_limit < 1) {
    return absl::InvalidArgumentError("generator: max_new_tokens_limit must be >= 1");
  }
  const int num_groups = contents.model.routing.num_groups;
  if (moe == nullptr || moe->num_groups() != num_groups ||
      static_cast<int>(contents.experts.size()) != num_groups) {
    return absl::InvalidArgumentError(absl::StrCat(
        "generator: checkpoint ", contents.dir, " has ", contents.experts.size(),
        " expert groups of ", num_groups, "; the MoE layers have ",
        moe == nullptr ? 0 : moe->num_groups()));
  }
  std::unique_ptr<Generator> g(new Generator());
  g->options_ = options;
  g->model_options_ = contents.model;
  g->checkpoint_step_ = contents.step;
  g->checkpoint_dir_ = contents.dir;
  if (options.load_expert_state) {
    for (int group = 0; group < num_groups; ++group) {
      if (absl::Status s = moe->LoadExpertState(group, contents.experts[group]); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("generator: loading expert group ", group,
                                                   " from ", contents.dir, ": ", s.message()));
      }
    }
  }
  absl::StatusOr<std::shared_ptr<TransformerLM>> model = TransformerLM::Create(contents.model, moe);
  if (!model.ok()) {
    return absl::Status(model.status().code(),
                        absl::StrCat("generator: checkpoint ", contents.dir, ": ",
                                     model.status().message()));
  }
  g->model_ = *std::move(model);
  HIMOE_RETURN_IF_ERROR(RestoreDenseState(contents, *g->model_));
  g->model_->eval();
  return g;
}

absl::StatusOr<at::Tensor> Generator::NextTokenLogits(const std::vector<int64_t>& context) {
  std::lock_guard<std::mutex> lock(mu_);
  return NextTokenLogitsLocked(context);
}

absl::StatusOr<at::Tensor> Generator::NextTokenLogitsLocked(const std::vector<int64_t>& context) {
  if (context.empty()) return absl::InvalidArgumentError("generator: empty context");
  const int64_t keep = std::min<int64_t>(context.size(), model_options_.block_size);
  at::Tensor idx;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    idx = at::tensor(std::vector<int64_t>(context.end() - keep, context.end()), at::kLong)
              .view({1, keep});
    return absl::OkStatus();
  }));
  torch::NoGradGuard no_grad;
  // Inference keeps no state on the groups, so the step / micro-batch keys
  // are irrelevant.
  HIMOE_ASSIGN_OR_RETURN(ModelOutput out,
                         model_->Forward(idx, at::Tensor(), 0, 0, /*training=*/false));
  return out.logits[0][keep - 1].to(at::kFloat);
}

absl::Status Generator::Generate(const GenerateParams& params,
                                 const std::function<bool(int64_t)>& on_token) {
  HIMOE_RETURN_IF_ERROR(ValidateGenerateParams(params, *this));
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> context = params.prompt;
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(params.seed);
  for (int i = 0; i < params.max_new_tokens; ++i) {
    HIMOE_ASSIGN_OR_RETURN(at::Tensor logits, NextTokenLogitsLocked(context));
    int64_t token = 0;
    HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
      if (params.temperature == 0) {
        token = logits.argmax().item<int64_t>();
        return absl::OkStatus();
      }
      // Shifted first, so that a tiny temperature overflows to -inf (weight
      // 0) rather than to inf - inf = NaN: the limit is greedy.
      at::Tensor scaled = (logits - logits.max()) / params.temperature;
      if (params.top_k > 0 && params.top_k < scaled.size(0)) {
        const at::Tensor kth = std::get<0>(at::topk(scaled, params.top_k)).select(0, -1);
        scaled = scaled.masked_fill(scaled < kth, -std::numeric_limits<float>::infinity());
      }
      token = at::multinomial(at::softmax(scaled, -1), 1, /*replacement=*/false, rng)
                  .item<int64_t>();
      return absl::OkStatus();
    }));
    context.push_back(token);
    if (!on_token(token)) {
      return absl::CancelledError(absl::StrCat("generation cancelled after ", i + 1, " tokens"));
    }
  }
  return absl::OkStatus();
}

}  // namespace himoe::model
