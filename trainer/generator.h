#ifndef HIMOE_TRAINER_GENERATOR_H_
#define HIMOE_TRAINER_GENERATOR_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "router_service/remote_moe.h"
#include "router_service/text_generator.h"
#include "trainer/expert_backend.h"
#include "trainer/model.h"

namespace himoe::trainer {

struct GeneratorOptions {
  // A checkpoint directory, or a checkpoints root (its newest is taken).
  std::string checkpoint;
  // One himoe-expert address per group; empty = the experts in this process.
  std::vector<std::string> expert_addresses;
  // Push the checkpoint's expert weights to the groups (SetState). Turn off
  // only when the groups already hold exactly these weights.
  bool load_expert_state = true;
  int max_new_tokens_limit = 4096;
  std::chrono::milliseconds deadline{60000};
};

// The trained LM of a checkpoint, sampling through its expert groups: the
// dense parts and routers here (eval mode, EMA frozen), the MoE layers on the
// groups. nanoGPT's sampling: the context is cropped to the last block_size
// tokens, logits / temperature, optional top-k, then one multinomial draw from
// a generator seeded per request (temperature 0: argmax). One request runs at
// a time; the groups parallelise each forward.
class Generator final : public router::TextGenerator {
 public:
  static absl::StatusOr<std::unique_ptr<Generator>> Create(const GeneratorOptions& options);

  int64_t vocab_size() const override { return model_options_.vocab_size; }
  bool byte_level() const override { return model_options_.vocab_size == 256; }
  int max_new_tokens_limit() const override { return options_.max_new_tokens_limit; }
  absl::Status Generate(const router::GenerateParams& params,
                        const std::function<bool(int64_t)>& on_token) override;

  // Logits [vocab] of the token after `context` (cropped to block_size).
  absl::StatusOr<at::Tensor> NextTokenLogits(const std::vector<int64_t>& context);

  // Gives a serving RemoteMoE (himoe-router's RouteForward) this model's
  // trained routers: gates, logit EMA, loss_free bias. The layer count and
  // sizes must match.
  absl::Status CopyRoutersTo(router::RemoteMoE& moe);
  router::RouterLayer& router(int moe_layer) { return model_->router(moe_layer); }

  const ModelOptions& model_options() const { return model_options_; }
  int64_t checkpoint_step() const { return checkpoint_step_; }
  const std::string& checkpoint_dir() const { return checkpoint_dir_; }

 private:
  Generator() = default;
  absl::StatusOr<at::Tensor> NextTokenLogitsLocked(const std::vector<int64_t>& context);

  GeneratorOptions options_;
  ModelOptions model_options_;
  int64_t checkpoint_step_ = 0;
  std::string checkpoint_dir_;
  std::unique_ptr<ExpertBackend> experts_;
  std::shared_ptr<TransformerLM> model_;
  std::mutex mu_;
};

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_GENERATOR_H_
