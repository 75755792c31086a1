#ifndef HIMOE_TRAINER_MODEL_H_
#define HIMOE_TRAINER_MODEL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "absl/status/statusor.h"
#include "router_service/router_layer.h"
#include "trainer/expert_backend.h"

namespace himoe::trainer {

struct ModelOptions {
  int64_t vocab_size = 256;
  int64_t block_size = 64;
  int n_layer = 4;
  int n_head = 4;
  int64_t d_model = 128;
  int64_t d_ff = 256;       // expert hidden width
  int64_t dense_ff = 512;   // hidden width of the dense FFNs (non-MoE layers)
  // MoE FFN on every layer (1) or on every other layer, starting at layer 1 (2).
  int moe_every = 1;
  router::RoutingConfig routing;
  uint64_t seed = 1;
};

// Transformer layer i has an MoE FFN when this returns its MoE index, else -1.
int MoeIndex(const ModelOptions& options, int layer);
int NumMoeLayers(const ModelOptions& options);
// The expert-backend sizes of this model (no addresses, no RPC hook).
ExpertBackendOptions ExpertBackendOptionsFor(const ModelOptions& options);

struct ModelOutput {
  at::Tensor logits;     // [B, T, V]
  at::Tensor task_loss;  // cross entropy (when targets are given)
  router::RoutingLosses aux;  // summed over MoE layers
  std::vector<router::RoutingStats> stats;  // per MoE layer
};

// nanoGPT-style decoder-only LM: token + position embeddings, pre-norm
// blocks with causal self-attention, weight-tied head. The dense parts and
// the routers (gate, EMA, loss_free bias) live here; the experts live in an
// ExpertBackend (in-process or remote services).
class TransformerLM : public torch::nn::Module {
 public:
  static absl::StatusOr<std::shared_ptr<TransformerLM>> Create(const ModelOptions& options,
                                                               ExpertBackend* experts);

  // idx, targets: int64 [B, T]. `step` and `micro_batch` key the remote
  // experts' saved state.
  absl::StatusOr<ModelOutput> Forward(const at::Tensor& idx, const at::Tensor& targets,
                                      uint64_t step, uint32_t micro_batch, bool training);

  router::RouterLayer& router(int moe_layer) { return *routers_[moe_layer]; }
  int num_moe_layers() const { return static_cast<int>(routers_.size()); }
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

  TransformerLM(const ModelOptions& options, ExpertBackend* experts);
  at::Tensor Attention(Block& block, const at::Tensor& x);
  absl::StatusOr<at::Tensor> MoeFfn(int moe, const at::Tensor& x, uint64_t step,
                                    uint32_t micro_batch, bool training, ModelOutput* out);

  ModelOptions options_;
  ExpertBackend* experts_;
  torch::nn::Embedding wte_{nullptr}, wpe_{nullptr};
  torch::nn::LayerNorm ln_f_{nullptr};
  std::vector<Block> blocks_;
  std::vector<std::unique_ptr<router::RouterLayer>> routers_;
};

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_MODEL_H_
