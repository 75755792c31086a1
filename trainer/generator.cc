#include "trainer/generator.h"

#include <limits>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "trainer/checkpoint.h"

namespace himoe::trainer {

absl::StatusOr<std::unique_ptr<Generator>> Generator::Create(const GeneratorOptions& options) {
  if (options.max_new_tokens_limit < 1) {
    return absl::InvalidArgumentError("generator: max_new_tokens_limit must be >= 1");
  }
  ASSIGN_OR_RETURN(CheckpointContents contents, ReadCheckpoint(options.checkpoint));
  std::unique_ptr<Generator> g(new Generator());
  g->options_ = options;
  g->model_options_ = contents.model;
  g->checkpoint_step_ = contents.step;
  g->checkpoint_dir_ = contents.dir;
  const ModelOptions& m = contents.model;

  ExpertBackendOptions eo = ExpertBackendOptionsFor(m);
  eo.deadline = options.deadline;
  const bool remote = !options.expert_addresses.empty();
  if (remote) {
    if (static_cast<int>(options.expert_addresses.size()) != eo.num_groups) {
      return absl::InvalidArgumentError(absl::StrCat(
          "generator: ", options.expert_addresses.size(), " expert addresses for a model with ",
          eo.num_groups, " groups (checkpoint ", contents.dir, ")"));
    }
    eo.addresses = options.expert_addresses;
    ASSIGN_OR_RETURN(g->experts_, CreateRemoteBackend(eo));
  } else {
    ASSIGN_OR_RETURN(g->experts_, CreateInProcessBackend(eo));
  }
  if (!remote || options.load_expert_state) {
    for (int group = 0; group < eo.num_groups; ++group) {
      if (absl::Status s = g->experts_->SetState(group, contents.experts[group]); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("generator: loading expert group ", group,
                                                   " from ", contents.dir, ": ", s.message()));
      }
    }
  }
  ASSIGN_OR_RETURN(g->model_, TransformerLM::Create(m, g->experts_.get()));
  RETURN_IF_ERROR(RestoreDenseState(contents, *g->model_));
  g->model_->eval();
  return g;
}

absl::Status Generator::CopyRoutersTo(router::RemoteMoE& moe) {
  if (moe.num_layers() != model_->num_moe_layers() ||
      moe.options().d_model != model_options_.d_model ||
      moe.options().routing.num_experts != model_options_.routing.num_experts) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", checkpoint_dir_, " has ", model_->num_moe_layers(),
        " MoE layers, d_model ", model_options_.d_model, ", N ",
        model_options_.routing.num_experts, "; the router serves ", moe.num_layers(),
        " layers, d_model ", moe.options().d_model, ", N ", moe.options().routing.num_experts,
        " (the cluster file's model section must match the checkpoint)"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  return CatchTorchErrors([&] {
    torch::NoGradGuard no_grad;
    for (int l = 0; l < moe.num_layers(); ++l) {
      router::RouterLayer& from = model_->router(l);
      router::RouterLayer& to = moe.router(l);
      to.gate_weight().copy_(from.gate_weight());
      to.logit_ema().copy_(from.logit_ema());
      to.loss_free_bias().copy_(from.loss_free_bias());
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<at::Tensor> Generator::NextTokenLogits(const std::vector<int64_t>& context) {
  std::lock_guard<std::mutex> lock(mu_);
  return NextTokenLogitsLocked(context);
}

absl::StatusOr<at::Tensor> Generator::NextTokenLogitsLocked(const std::vector<int64_t>& context) {
  if (context.empty()) return absl::InvalidArgumentError("generator: empty context");
  const int64_t keep = std::min<int64_t>(context.size(), model_options_.block_size);
  at::Tensor idx;
  RETURN_IF_ERROR(CatchTorchErrors([&] {
    idx = at::tensor(std::vector<int64_t>(context.end() - keep, context.end()), at::kLong)
              .view({1, keep});
    return absl::OkStatus();
  }));
  torch::NoGradGuard no_grad;
  // Inference keeps no state on the groups, so the step / micro-batch keys
  // are irrelevant.
  ASSIGN_OR_RETURN(ModelOutput out, model_->Forward(idx, at::Tensor(), 0, 0, /*training=*/false));
  return out.logits[0][keep - 1].to(at::kFloat);
}

absl::Status Generator::Generate(const router::GenerateParams& params,
                                 const std::function<bool(int64_t)>& on_token) {
  RETURN_IF_ERROR(router::ValidateGenerateParams(params, *this));
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> context = params.prompt;
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(params.seed);
  for (int i = 0; i < params.max_new_tokens; ++i) {
    ASSIGN_OR_RETURN(at::Tensor logits, NextTokenLogitsLocked(context));
    int64_t token = 0;
    RETURN_IF_ERROR(CatchTorchErrors([&] {
      if (params.temperature == 0) {
        token = logits.argmax().item<int64_t>();
        return absl::OkStatus();
      }
      at::Tensor scaled = logits / params.temperature;
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

}  // namespace himoe::trainer
