#ifndef HIMOE_MODEL_GENERATOR_H_
#define HIMOE_MODEL_GENERATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "model/checkpoint_reader.h"
#include "model/model_config.h"
#include "model/moe_layers.h"
#include "model/text_generator.h"
#include "model/transformer_lm.h"

namespace himoe::model {

// nanoGPT's sampling of one token from logits [V]: temperature 0 is the
// argmax (the first of equal maxima); otherwise softmax(logits / T) over
// the top_k largest (0: all; ties with the k-th stay in), then of those the
// most likely whose probability first reaches top_p (1: all; ties stay in),
// one draw from `rng` (one 64-bit number, its top 53 bits a uniform u in
// [0, 1)): the first token whose cumulative weight exceeds u times the total.
absl::StatusOr<int64_t> SampleToken(const at::Tensor& logits, const GenerateParams& params,
                                    at::Generator& rng);

struct GeneratorOptions {
  int max_new_tokens_limit = 4096;
  // Streams decoded together (continuous batching: they join and leave
  // between steps); one more Generate is RESOURCE_EXHAUSTED.
  int max_streams = 64;
  // Each stream keeps its attention keys and values, so a step computes its
  // new token only; off, every step recomputes the whole context (the
  // reference).
  bool kv_cache = true;
  // Push the checkpoint's expert weights to the MoE layers' groups
  // (LoadExpertState). Turn off only when the groups already hold exactly
  // these weights.
  bool load_expert_state = true;
};

// The trained LM of a checkpoint, sampling through MoE layers (eval mode, EMA
// frozen): the dense parts here, the routers and experts in `moe`. nanoGPT's
// sampling: the context is cropped to the last block_size tokens, logits /
// temperature, optional top-k, then one draw (SampleToken) from a generator
// seeded per request (temperature 0: argmax). Concurrent requests are decoded
// together by one decoding thread, one token per stream per step, each
// stream routed as if alone: a stream samples the same text alone or beside
// others. With the KV cache a step feeds each stream its new token only,
// until the context passes block_size, from where it recomputes the cropped
// window (its positions shift), as the reference does.
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
  // Blocks until the stream ends; `on_token` runs on the decoding thread.
  absl::Status Generate(const GenerateParams& params,
                        const std::function<bool(int64_t)>& on_token) override;
  ~Generator() override;  // ends running streams with UNAVAILABLE

  GeneratorStats stats() const override;

  // Logits [vocab] of the token after `context` (cropped to block_size).
  absl::StatusOr<at::Tensor> NextTokenLogits(const std::vector<int64_t>& context);

  router::RouterLayer& router(int moe_layer) { return model_->router(moe_layer); }
  const ModelOptions& model_options() const { return model_options_; }
  int64_t checkpoint_step() const { return checkpoint_step_; }
  const std::string& checkpoint_dir() const { return checkpoint_dir_; }

 private:
  struct Stream;
  Generator() = default;
  absl::StatusOr<at::Tensor> NextTokenLogitsLocked(const std::vector<int64_t>& context);
  void DecodeLoop();
  // One step of `streams`: a token each (on_token called), or an error in
  // the stream's status; returns the tokens sampled.
  int Step(const std::vector<Stream*>& streams);
  // Logits [S, V] of each stream's next token.
  absl::StatusOr<at::Tensor> StepLogits(const std::vector<Stream*>& streams);

  GeneratorOptions options_;
  ModelOptions model_options_;
  int64_t checkpoint_step_ = 0;
  std::string checkpoint_dir_;
  std::shared_ptr<TransformerLM> model_;
  std::mutex model_mu_;  // the model: decoding steps and NextTokenLogits
  std::unique_ptr<KvCachePool> kv_pool_;  // the streams' caches (kv_cache)

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Stream*> streams_;  // joined, not ended
  bool stopping_ = false;
  GeneratorStats stats_;
  std::thread decoder_;
};

}  // namespace himoe::model

#endif  // HIMOE_MODEL_GENERATOR_H_
