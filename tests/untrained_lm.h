#ifndef HIMOE_TESTS_UNTRAINED_LM_H_
#define HIMOE_TESTS_UNTRAINED_LM_H_

#include <memory>

#include "absl/status/statusor.h"
#include "common/status_macros.h"
#include "model/checkpoint_reader.h"
#include "model/generator.h"
#include "model/model_config.h"
#include "model/transformer_lm.h"
#include "trainer/backend_moe.h"
#include "trainer/expert_backend.h"

namespace himoe::testing {

// A freshly initialised LM of `options` on in-process experts, ready to
// sample: for fuzzing and benches, where the weights do not matter.
struct UntrainedLm {
  std::unique_ptr<trainer::ExpertBackend> experts;
  std::unique_ptr<trainer::BackendMoE> moe;
  std::unique_ptr<model::Generator> generator;
};

// `go.load_expert_state` is ignored: the groups keep their seed's experts.
inline absl::StatusOr<std::unique_ptr<UntrainedLm>> MakeUntrainedLm(
    const model::ModelOptions& options, model::GeneratorOptions go) {
  auto lm = std::make_unique<UntrainedLm>();
  trainer::ExpertBackendOptions eo;
  eo.shape = model::ExpertShapeFor(options);
  HIMOE_ASSIGN_OR_RETURN(lm->experts, trainer::CreateInProcessBackend(eo));
  HIMOE_ASSIGN_OR_RETURN(lm->moe, trainer::BackendMoE::Create(options, lm->experts.get()));
  model::CheckpointContents contents;
  contents.model = options;
  HIMOE_ASSIGN_OR_RETURN(auto fresh, model::TransformerLM::Create(options, lm->moe.get()));
  contents.dense = model::DenseState(*fresh);
  contents.experts.resize(options.routing.num_groups);
  go.load_expert_state = false;
  HIMOE_ASSIGN_OR_RETURN(lm->generator, model::Generator::Create(contents, lm->moe.get(), go));
  return lm;
}

}  // namespace himoe::testing

#endif  // HIMOE_TESTS_UNTRAINED_LM_H_
