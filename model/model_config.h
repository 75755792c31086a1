#ifndef HIMOE_MODEL_MODEL_CONFIG_H_
#define HIMOE_MODEL_MODEL_CONFIG_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "himoe/v1/cluster.pb.h"
#include "himoe/v1/model.pb.h"
#include "router_service/routing/routing_config.h"

namespace himoe::model {

// The language model's architecture (v1::ModelConfig as a C++ struct).
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
  v1::DType expert_dtype = v1::DTYPE_FLOAT32;  // or DTYPE_BFLOAT16
  // DTYPE_BFLOAT16: the products of the experts and of the attention
  // projections take bfloat16-rounded operands and sum in float32
  // (MatmulBf16Out); weights, gradients and optimizer state stay float32.
  // A training setting: checkpoints do not record it.
  v1::DType matmul_dtype = v1::DTYPE_FLOAT32;
  // Fresh weights: the model's, the gates' and the experts' (v1::WeightInit).
  v1::WeightInit init = v1::WEIGHT_INIT_DEFAULT;
};

// The init a preset implies: WEIGHT_INIT_SWITCH for "reference" (the
// released configs set use_switch_tfm_init), else WEIGHT_INIT_DEFAULT.
v1::WeightInit InitForPreset(absl::string_view preset);

// Transformer layer i has an MoE FFN when this returns its MoE index, else -1.
int MoeIndex(const ModelOptions& options, int layer);
int NumMoeLayers(const ModelOptions& options);

// InvalidArgument naming the field: the routing config, the sizes, moe_every,
// at least one MoE layer.
absl::Status ValidateModelOptions(const ModelOptions& options);

// Model FLOPs of one training token (forward + backward), counting the
// matmuls only, as nanoGPT's MFU does (PaLM appendix B): a forward
// multiply-add is 2 FLOPs and backward costs twice forward, so 6 FLOPs per
// multiply-add. Per token and layer: QKV and output projections 4 d^2,
// attention scores and values 2 T d (T = block_size, the full T x T product
// is computed and masked), then either the router d N plus K experts of
// 2 d d_ff each (K = total_k) or the dense FFN 2 d dense_ff; once per token
// the tied LM head d V. Dropped tokens (capacity) still count.
double TrainingFlopsPerToken(const ModelOptions& options);

// The experts of this model.
v1::ExpertShape ExpertShapeFor(const ModelOptions& options);

v1::ModelConfig ModelConfigToProto(const ModelOptions& options);
// InvalidArgument naming the field for an unknown name or an invalid routing
// config.
absl::StatusOr<ModelOptions> ModelOptionsFromProto(const v1::ModelConfig& config);

// Every field of `config`, the enums by name.
v1::RoutingSettings RoutingSettingsToProto(const router::RoutingConfig& config);
absl::StatusOr<router::RoutingConfig> RoutingConfigFromProto(const v1::RoutingSettings& settings);

// The routing config a cluster file describes (model sizes, method, preset,
// then the explicit overrides), validated.
absl::StatusOr<router::RoutingConfig> RoutingConfigFromCluster(const v1::ClusterConfig& cluster);

}  // namespace himoe::model

#endif  // HIMOE_MODEL_MODEL_CONFIG_H_
