// The router's Generate handler on arbitrary bytes parsed as a
// GenerateRequest: decoded against a real (small, untrained) language model
// on in-process experts, then sampled. Either INVALID_ARGUMENT, or exactly
// max_new_tokens tokens, each a token id of the model; never a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status_macros.h"
#include "himoe/v1/router.pb.h"
#include "model/checkpoint_reader.h"
#include "model/generator.h"
#include "model/model_config.h"
#include "model/transformer_lm.h"
#include "router_service/router_grpc_service.h"
#include "trainer/backend_moe.h"
#include "trainer/expert_backend.h"

namespace {

using himoe::model::Generator;

struct Model {
  std::unique_ptr<himoe::trainer::ExpertBackend> experts;
  std::unique_ptr<himoe::trainer::BackendMoE> moe;
  std::unique_ptr<Generator> generator;
};

absl::StatusOr<std::unique_ptr<Model>> MakeModel() {
  himoe::model::CheckpointContents contents;
  himoe::model::ModelOptions& o = contents.model;
  o.n_layer = 1;
  o.n_head = 2;
  o.d_model = 16;
  o.d_ff = 16;
  o.dense_ff = 32;
  o.block_size = 8;  // prompts longer than this are cropped
  o.routing.num_experts = 4;
  o.routing.num_groups = 2;
  o.routing.top_k = 1;
  auto m = std::make_unique<Model>();
  himoe::trainer::ExpertBackendOptions eo;
  eo.shape = himoe::model::ExpertShapeFor(o);
  HIMOE_ASSIGN_OR_RETURN(m->experts, himoe::trainer::CreateInProcessBackend(eo));
  HIMOE_ASSIGN_OR_RETURN(m->moe, himoe::trainer::BackendMoE::Create(o, m->experts.get()));
  // The dense state of a freshly built model; the groups keep their seed's
  // experts (contents.experts stays empty per group, and is not loaded).
  HIMOE_ASSIGN_OR_RETURN(auto fresh, himoe::model::TransformerLM::Create(o, m->moe.get()));
  contents.dense = himoe::model::DenseState(*fresh);
  contents.experts.resize(o.routing.num_groups);
  himoe::model::GeneratorOptions go;
  go.load_expert_state = false;
  go.max_new_tokens_limit = 4;
  HIMOE_ASSIGN_OR_RETURN(m->generator, Generator::Create(contents, m->moe.get(), go));
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Model* const model = [] {
    auto m = MakeModel();
    if (!m.ok()) std::abort();
    return m->release();
  }();
  himoe::v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto params = himoe::router::DecodeGenerateRequest(request, *model->generator);
  if (!params.ok()) {
    if (!absl::IsInvalidArgument(params.status())) std::abort();
    return 0;
  }
  int tokens = 0;
  const absl::Status status = model->generator->Generate(*params, [&](int64_t token) {
    if (token < 0 || token >= model->generator->vocab_size()) std::abort();
    ++tokens;
    return true;
  });
  if (!status.ok() || tokens != params->max_new_tokens) std::abort();
  return 0;
}
