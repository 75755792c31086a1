#ifndef HIMOE_MODEL_GENERATOR_H_
#define HIMOE_MODEL_GENERATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "model/checkpoint_reader.h"
#include "model/model_config.h"
#include "model/moe_layers.h"
#include "model/text_generator.h"
#include "model/transformer_lm.h"

namespace himoe::model {

struct GeneratorOptions {
  int max_new_tokens_limit = 4096;
  // Push the checkpoint's expert weights to the MoE layers' groups
  // (LoadExpertState). Turn off only when the groups already hold exactly
  // these weights.
  bool load_expert_state = true;
};

// The trained LM of a checkpoint, sampling through MoE layers (eval mode, EMA
// frozen): the dense parts here, the routers and experts in `moe`. nanoGPT's
// sampling: the context is cropped to the last block_size tokens, logits /
// temperature, optional top-k, then one multinomial draw from a generator
// seeded per request (temperature 0: argmax). One request runs at a time.
class Generator final : public TextGenerator {
 public:
  // Builds the LM on `moe` (not owned; must outlive the generator), loads the
  // experts' state when options.load_expert_state, and restores the dense
  // state, which gives `moe`'s routers the trained gates, logit EMA and
  // loss_free bias.
  static absl::StatusOr<std::unique_ptr<Generator>> Create(const CheckpointContents& contents,
                                                           MoELayers* moe,
                                                           const GeneratorOptions& options);

  int64_t vocab_size() const override { return model_options_.vocab_size; }
  bool byte_level() const override { return model_options_.vocab_size == 256; }
  int max_new_tokens_limit() const override { return options_.max_new_tokens_limit; }
  absl::Status Generate(const GenerateParams& params,
                        const std::function<bool(int64_t)>& on_token) override;

  // Logits [vocab] of the token after `context` (cropped to block_size).
  absl::StatusOr<at::Tensor> NextTokenLogits(const std::vector<int64_t>& context);

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
  std::shared_ptr<TransformerLM> model_;
  std::mutex mu_;
};

}  // namespace himoe::model

#endif  // HIMOE_MODEL_GENERATOR_H_
