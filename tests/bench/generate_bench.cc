// himoe-generate-bench: Generate's decoding throughput, in one run.
//
//   * the KV cache against full recompute: one stream, a 192-token prompt, 64
//     new tokens (contexts 192 to 255 of a 256-token block);
//   * continuous batching: 8 concurrent streams against 1 (16-token prompts,
//     64 new tokens each, the KV cache on), total tokens/s.
//
// The model is the shipped cluster file's (d_model 256, d_ff 1024, 8 experts
// in 4 groups, k 1) with 2 layers, 4 heads and a 256-token block, untrained
// (the cost does not depend on the weights), its experts in this process.
// Prints a Markdown table (scripts/bench.sh generate writes it to
// runs/bench/generate.md).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "common/compute_setup.h"
#include "common/program.h"
#include "common/status_macros.h"
#include "model/generator.h"
#include "tests/untrained_lm.h"

ABSL_FLAG(int32_t, threads, 0, "torch threads; 0 = all cores");
ABSL_FLAG(int32_t, new_tokens, 64, "tokens each stream samples");
ABSL_FLAG(int32_t, streams, 8, "concurrent streams of the batching run");
ABSL_FLAG(std::string, out, "", "also write the table here");

namespace himoe {
namespace {

absl::StatusOr<std::unique_ptr<testing::UntrainedLm>> MakeLm(bool kv_cache) {
  model::ModelOptions o;
  o.n_layer = 2;
  o.n_head = 4;
  o.d_model = 256;
  o.d_ff = 1024;
  o.dense_ff = 1024;
  o.block_size = 256;
  o.routing.num_experts = 8;
  o.routing.num_groups = 4;
  o.routing.top_k = 1;
  model::GeneratorOptions go;
  go.kv_cache = kv_cache;
  return testing::MakeUntrainedLm(o, go);
}

model::GenerateParams Params(int prompt_tokens, int new_tokens, uint64_t seed) {
  model::GenerateParams p;
  for (int i = 0; i < prompt_tokens; ++i) p.prompt.push_back(32 + (i * 7 + seed) % 90);
  p.max_new_tokens = new_tokens;
  p.temperature = 1.0;
  p.seed = seed;
  return p;
}

// Total tokens/s of `streams` concurrent Generate calls.
absl::StatusOr<double> TokensPerSecond(model::Generator& g, int streams, int prompt_tokens,
                                       int new_tokens) {
  std::vector<absl::Status> status(streams);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int s = 0; s < streams; ++s) {
    threads.emplace_back([&, s] {
      status[s] = g.Generate(Params(prompt_tokens, new_tokens, 1 + s), [](int64_t) { return true; });
    });
  }
  for (auto& t : threads) t.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const absl::Status& s : status) HIMOE_RETURN_IF_ERROR(s);
  return streams * new_tokens / seconds;
}

absl::Status Run() {
  HIMOE_RETURN_IF_ERROR(ConfigureServingCompute(absl::GetFlag(FLAGS_threads), true));
  const int n = absl::GetFlag(FLAGS_new_tokens), streams = absl::GetFlag(FLAGS_streams);
  HIMOE_ASSIGN_OR_RETURN(auto cached, MakeLm(true));
  HIMOE_ASSIGN_OR_RETURN(auto full, MakeLm(false));
  // Warm-up: the first products set up BLAS and the allocator.
  HIMOE_RETURN_IF_ERROR(TokensPerSecond(*cached->generator, 1, 16, 4).status());
  HIMOE_RETURN_IF_ERROR(TokensPerSecond(*full->generator, 1, 16, 4).status());
  HIMOE_ASSIGN_OR_RETURN(const double kv, TokensPerSecond(*cached->generator, 1, 192, n));
  HIMOE_ASSIGN_OR_RETURN(const double recompute, TokensPerSecond(*full->generator, 1, 192, n));
  HIMOE_ASSIGN_OR_RETURN(const double one, TokensPerSecond(*cached->generator, 1, 16, n));
  HIMOE_ASSIGN_OR_RETURN(const double many,
                         TokensPerSecond(*cached->generator, streams, 16, n));
  const model::GeneratorStats stats = cached->generator->stats();
  std::string table = absl::StrFormat(
      "| Generate (d 256, 2 layers, 8 experts in 4 groups, in process) | tokens/s | ratio |\n"
      "|---|---|---|\n"
      "| 1 stream, contexts 192-255, full recompute | %.1f | 1.00 |\n"
      "| 1 stream, contexts 192-255, KV cache | %.1f | %.2f |\n"
      "| 1 stream, contexts 16-79, KV cache | %.1f | 1.00 |\n"
      "| %d concurrent streams, contexts 16-79, KV cache (total) | %.1f | %.2f |\n",
      recompute, kv, kv / recompute, one, streams, many, many / one);
  absl::StrAppendFormat(&table, "\n(%ld decoding steps for %ld tokens in all runs of the KV-cache "
                        "model.)\n", stats.steps, stats.tokens);
  std::fputs(table.c_str(), stdout);
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) {
    std::ofstream(out) << table;
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace himoe

int main(int argc, char** argv) {
  himoe::ParseCommandLine(argc, argv,
                          "Generate's throughput: KV cache vs recompute, N streams vs 1.");
  const absl::Status s = himoe::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "himoe-generate-bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
