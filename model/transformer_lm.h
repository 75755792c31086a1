#ifndef HIMOE_MODEL_TRANSFORMER_LM_H_
#define HIMOE_MODEL_TRANSFORMER_LM_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "absl/status/statusor.h"
#include "model/kv_cache.h"
#include "model/model_config.h"
#include "model/moe_layers.h"
#include "router_service/routing/router_layer.h"

namespace himoe::model {

struct ModelOutput {
  at::Tensor logits;     // [B, T, V]
  at::Tensor task_loss;  // cross entropy (when targets are given)
  router::RoutingLosses aux;  // summed over MoE layers (the terms they define)
  std::vector<router::RoutingStats> stats;  // per MoE layer
};

// nanoGPT-style decoder-only LM: token + position embeddings, pre-norm
// blocks with causal self-attention, weight-tied head. The dense parts live
// here; each MoE FFN is a call into `moe`, whose routers' tensors the LM
// registers as its own: parameters "moe<l>_gate" and (reference preset,
// grouped methods) "moe<l>_router_scale"; buffers "moe<l>_logit_ema",
// "moe<l>_loss_free_bias", "moe<l>_balance_upper", "moe<l>_balance_lower" and
// "moe<l>_route_calls" (checkpoints depend on these names).
class TransformerLM : public torch::nn::Module {
 public:
  // `moe` (not owned) must outlive the LM and have NumMoeLayers(options)
  // layers of options.routing.num_groups groups.
  static absl::StatusOr<std::shared_ptr<TransformerLM>> Create(const ModelOptions& options,
                                                               MoELayers* moe);

  // idx, targets: int64 [B, T]. `step` and `micro_batch` key the experts'
  // saved state in training.
  absl::StatusOr<ModelOutput> Forward(const at::Tensor& idx, const at::Tensor& targets,
                                      uint64_t step, uint32_t micro_batch, bool training);

  // Inference with a KV cache, for several sequences at once: appends
  // tokens[s] to caches[s] (positions caches[s]->length on; the total may not
  // pass block_size; every cache from one KvCachePool of this model's
  // NewKvCachePool shape) and returns the logits [S, V] of each sequence's
  // last new token. Every row-wise part runs once over all sequences' new
  // rows (an MoE layer gets them as one call, a segment per sequence); the
  // sequences that add one token attend together (one gather of their keys,
  // masked to each one's length), longer ones (prompts) one by one. Equal to
  // Forward on each whole sequence.
  absl::StatusOr<at::Tensor> DecodeStep(const std::vector<std::vector<int64_t>>& tokens,
                                        const std::vector<KvCache*>& caches);

  // A cache pool for DecodeStep: one slot of block_size rows per sequence.
  std::unique_ptr<KvCachePool> NewKvCachePool() const;

  router::RouterLayer& router(int moe_layer) { return moe_->router(moe_layer); }
  int num_moe_layers() const { return moe_->num_layers(); }
  MoELayers& moe() { return *moe_; }
  const ModelOptions& options() const { return options_; }

  // Parameters that get AdamW weight decay (matrices, embeddings, gates)
  // and those that do not (biases, LayerNorm).
  std::vector<at::Tensor> DecayedParameters() const;
  std::vector<at::Tensor> UndecayedParameters() const;

 private:
  struct Block {
    torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
    torch::nn::Linear qkv{nullptr}, proj{nullptr};
    torch::nn::Linear fc{nullptr}, fc_out{nullptr};  // dense FFN only
    int moe = -1;
  };

  TransformerLM(const ModelOptions& options, MoELayers* moe);
  at::Tensor Attention(Block& block, const at::Tensor& x);
  // linear(x), through LinearBf16 under matmul_dtype bfloat16.
  at::Tensor Project(torch::nn::Linear& linear, const at::Tensor& x);
  // Attention cores (before the output projection) against block `index`'s
  // keys and values in `pool`, which already hold the new rows. One
  // sequence's n new queries q [n, C] at positions past..past+n-1; [n, C].
  at::Tensor CachedAttention(KvCachePool& pool, size_t index, const at::Tensor& q, int slot,
                             int64_t past);
  // One new query per sequence, q [S, C], sequence s in slots[s], against the
  // first `keys` keys (its new one included), minus those where key_mask
  // [S, 1, 1, keys] is true (undefined: none); [S, C].
  at::Tensor BatchedCachedAttention(KvCachePool& pool, size_t index, const at::Tensor& q,
                                    const at::Tensor& slots, int64_t keys,
                                    const at::Tensor& key_mask);
  absl::StatusOr<at::Tensor> MoeFfn(int moe, const at::Tensor& x, const MoECall& call,
                                    ModelOutput* out);

  ModelOptions options_;
  MoELayers* moe_;
  torch::nn::Embedding wte_{nullptr}, wpe_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
  std::vector<Block> blocks_;
};

}  // namespace himoe::model

#endif  // HIMOE_MODEL_TRANSFORMER_LM_H_
