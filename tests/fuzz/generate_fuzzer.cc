// The router's Generate handler on arbitrary bytes parsed as a
// GenerateRequest: decoded against a real (small, untrained) language model
// on in-process experts, then sampled with its stop sequences as the router
// does. Either INVALID_ARGUMENT, or tokens of the model: exactly
// max_new_tokens when no stop sequence ended the stream, at most that when
// one did; never a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "himoe/v1/router.pb.h"
#include "router_service/router_grpc_service.h"
#include "tests/untrained_lm.h"

namespace {

absl::StatusOr<std::unique_ptr<himoe::testing::UntrainedLm>> MakeModel() {
  himoe::model::ModelOptions o;
  o.n_layer = 1;
  o.n_head = 2;
  o.d_model = 16;
  o.d_ff = 16;
  o.dense_ff = 32;
  o.block_size = 8;  // prompts longer than this are cropped
  o.routing.num_experts = 4;
  o.routing.num_groups = 2;
  o.routing.top_k = 1;
  himoe::model::GeneratorOptions go;
  go.max_new_tokens_limit = 4;
  return himoe::testing::MakeUntrainedLm(o, go);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static himoe::testing::UntrainedLm* const model = [] {
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
  const absl::StatusOr<himoe::model::FinishReason> finished =
      himoe::model::GenerateUntilStop(*model->generator, *params, [&](int64_t token) {
        if (token < 0 || token >= model->generator->vocab_size()) std::abort();
        ++tokens;
        return true;
      });
  if (!finished.ok() || tokens > params->max_new_tokens) std::abort();
  if (*finished == himoe::model::FinishReason::kLength && tokens != params->max_new_tokens) {
    std::abort();
  }
  return 0;
}
