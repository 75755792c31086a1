// himoe_serve_reference: the in-process answers of a checkpoint, for clients
// that check a serving router (scripts/chaos.py serve). The LM, its routers
// and every expert group run in this process (BackendMoE on the in-process
// backend, as tests/trainer/generate_test.cc's reference); it writes
//   forward_<i>_x.pb, forward_<i>_y.pb   RouteForward input [T, d_model] and
//                                        output of MoE layer i % layers
//                                        (serialized himoe.v1.Tensor)
//   manifest.json                        those files and each Generate
//                                        request with the tokens it samples
#include <cstdint>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file_util.h"
#include "common/program.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "common/torch_runtime.h"
#include "model/checkpoint_reader.h"
#include "model/generator.h"
#include "model/model_config.h"
#include "trainer/backend_moe.h"
#include "trainer/expert_backend.h"

ABSL_FLAG(std::string, checkpoint, "", "a step_* directory, or the checkpoints root (newest)");
ABSL_FLAG(std::string, out_dir, "", "where the files go");
ABSL_FLAG(int, forward_requests, 8, "RouteForward inputs, over the MoE layers in turn");
ABSL_FLAG(int64_t, tokens, 16, "rows of each RouteForward input");
ABSL_FLAG(uint64_t, seed, 1, "seed of the RouteForward inputs");
ABSL_FLAG(std::vector<std::string>, prompts, {}, "Generate prompts (bytes), comma-separated");
ABSL_FLAG(int, new_tokens, 16, "tokens each Generate request samples");

namespace himoe::trainer {
namespace {

absl::Status WriteTensor(const at::Tensor& t, const std::string& path) {
  v1::Tensor proto;
  HIMOE_RETURN_IF_ERROR(EncodeTensor(t.contiguous(), &proto));
  return WriteFileAtomically(path, proto.SerializeAsString());
}

absl::Status Run() {
  const std::string dir = absl::GetFlag(FLAGS_out_dir);
  if (absl::GetFlag(FLAGS_checkpoint).empty() || dir.empty()) {
    return absl::InvalidArgumentError("--checkpoint and --out_dir are required");
  }
  HIMOE_ASSIGN_OR_RETURN(const model::CheckpointContents contents,
                         model::ReadCheckpoint(absl::GetFlag(FLAGS_checkpoint)));
  ExpertBackendOptions eo;
  eo.shape = model::ExpertShapeFor(contents.model);
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<ExpertBackend> experts, CreateInProcessBackend(eo));
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<BackendMoE> moe,
                         BackendMoE::Create(contents.model, experts.get()));
  model::GeneratorOptions go;
  go.kv_cache = false;  // the reference: every token from the whole context
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<model::Generator> generator,
                         model::Generator::Create(contents, moe.get(), go));

  nlohmann::json manifest;
  manifest["checkpoint"] = contents.dir;
  manifest["step"] = contents.step;
  manifest["forward"] = nlohmann::json::array();
  manifest["generate"] = nlohmann::json::array();
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    at::Generator rng = at::detail::createCPUGenerator(absl::GetFlag(FLAGS_seed));
    for (int i = 0; i < absl::GetFlag(FLAGS_forward_requests); ++i) {
      const int layer = i % moe->num_layers();
      const at::Tensor x = at::randn({absl::GetFlag(FLAGS_tokens), contents.model.d_model}, rng);
      model::MoECall call;
      HIMOE_ASSIGN_OR_RETURN(router::MoEOutput y, moe->Forward(layer, x, call));
      const std::string xs = absl::StrCat("forward_", i, "_x.pb");
      const std::string ys = absl::StrCat("forward_", i, "_y.pb");
      HIMOE_RETURN_IF_ERROR(WriteTensor(x, absl::StrCat(dir, "/", xs)));
      HIMOE_RETURN_IF_ERROR(WriteTensor(y.output.detach(), absl::StrCat(dir, "/", ys)));
      manifest["forward"].push_back({{"layer", layer}, {"x", xs}, {"y", ys}});
    }
    return absl::OkStatus();
  }));
  // Greedy, and sampled with a seed: both are one exact token sequence.
  for (const std::string& prompt : absl::GetFlag(FLAGS_prompts)) {
    for (const double temperature : {0.0, 0.8}) {
      model::GenerateParams p;
      for (const char c : prompt) p.prompt.push_back(static_cast<unsigned char>(c));
      p.max_new_tokens = absl::GetFlag(FLAGS_new_tokens);
      p.temperature = temperature;
      p.top_k = temperature > 0 ? 20 : 0;
      p.seed = 7;
      HIMOE_RETURN_IF_ERROR(model::ValidateGenerateParams(p, *generator));
      std::vector<int64_t> tokens;
      HIMOE_RETURN_IF_ERROR(generator->Generate(p, [&](int64_t t) {
        tokens.push_back(t);
        return true;
      }));
      manifest["generate"].push_back({{"prompt", prompt},
                                      {"max_new_tokens", p.max_new_tokens},
                                      {"temperature", p.temperature},
                                      {"top_k", p.top_k},
                                      {"seed", p.seed},
                                      {"tokens", tokens}});
    }
  }
  return WriteFileAtomically(absl::StrCat(dir, "/manifest.json"), manifest.dump(1));
}

}  // namespace
}  // namespace himoe::trainer

int main(int argc, char** argv) {
  himoe::InitProgram(argc, argv,
                     "Writes a checkpoint's in-process RouteForward and Generate answers.\n"
                     "  himoe_serve_reference --checkpoint=DIR --out_dir=DIR --prompts=a,b");
  const absl::Status s = himoe::trainer::Run();
  if (!s.ok()) {
    std::cerr << "himoe_serve_reference: " << s << "\n";
    return 1;
  }
  return 0;
}
