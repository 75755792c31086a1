// Shared set-up of the trainer tests: temp directories, a deterministic
// English-like corpus, and expert-group services on 127.0.0.1.
#ifndef HIMOE_TESTS_TRAINER_TRAINER_TEST_UTIL_H_
#define HIMOE_TESTS_TRAINER_TRAINER_TEST_UTIL_H_

#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "expert_service/expert_grpc_service.h"
#include "model/model_config.h"
#include "tests/temp_dir.h"
#include "trainer/trainer.h"

namespace himoe::trainer::testing {

using TempDir = test_util::TempDir;

// ~20 KB of varied English-like text, deterministic.
inline std::string CorpusText() {
  static const char* const kWords[] = {
      "the",     "expert",   "router",  "group",   "token",   "gradient", "layer",
      "quiet",   "river",    "mountain", "signal", "balance", "mixture",  "sparse",
      "dense",   "attention", "model",  "learns",  "slowly",  "quickly",  "under",
      "over",    "bright",   "window",  "carries", "every",   "small",    "large",
      "garden",  "number",   "seven",   "forty",   "question", "answer",  "moves",
      "through", "between",  "before",  "after",   "while"};
  std::mt19937 rng(12345);
  std::uniform_int_distribution<int> word(0, sizeof(kWords) / sizeof(kWords[0]) - 1);
  std::uniform_int_distribution<int> len(4, 14);
  std::string text;
  int line = 0;
  while (text.size() < 20000) {
    const int n = len(rng);
    std::string sentence;
    for (int i = 0; i < n; ++i) {
      std::string w = kWords[word(rng)];
      if (i == 0) w[0] = static_cast<char>(w[0] - 'a' + 'A');
      sentence += (i ? " " : "") + w;
    }
    sentence += (line % 3 == 0) ? "." : (line % 3 == 1 ? "?" : "!");
    if (line % 5 == 0) sentence += " (" + std::to_string(line * 37 % 1000) + ")";
    text += sentence + "\n";
    ++line;
  }
  return text;
}

// CorpusText() written to <dir>/corpus.txt; returns the file's path.
inline std::string WriteCorpus(const TempDir& dir) {
  const std::string path = dir.Sub("corpus.txt");
  std::ofstream(path, std::ios::binary) << CorpusText();
  return path;
}

// One in-process himoe-expert gRPC server per group of `o`'s model, on
// 127.0.0.1:0, stopped on destruction; taking shared memory when asked.
class ExpertCluster {
 public:
  // With `run_state_dir`, group g keeps its run in <dir>/group<g>.run.
  explicit ExpertCluster(const TrainerOptions& o, bool shared_memory = false,
                         const std::string& run_state_dir = "") {
    for (int g = 0; g < o.model.routing.num_groups; ++g) {
      expert::ExpertServerOptions s;
      s.address = "127.0.0.1:0";
      s.core.shape = model::ExpertShapeFor(o.model);
      s.core.group_id = g;
      s.core.shared_memory = shared_memory;
      if (!run_state_dir.empty()) {
        s.run_state_file = run_state_dir + "/group" + std::to_string(g) + ".run";
      }
      auto server = expert::ExpertServer::Start(s);
      EXPECT_TRUE(server.ok()) << server.status();
      if (!server.ok()) continue;
      addresses_.push_back("127.0.0.1:" + std::to_string((*server)->port()));
      options_.push_back(s);
      servers_.push_back(std::move(server).value());
    }
  }
  const std::vector<std::string>& addresses() const { return addresses_; }
  // Stops group g's server (its address then refuses connections).
  void Shutdown(int g) {
    servers_[g]->Shutdown();
    servers_[g]->Wait();
  }
  // Starts group g again on its address, as a new process: the seed's
  // weights, no run begun; or, with a run state file, the run it holds.
  void Restart(int g) {
    servers_[g].reset();
    expert::ExpertServerOptions s = options_[g];
    s.address = addresses_[g];
    auto server = expert::ExpertServer::Start(s);
    ASSERT_TRUE(server.ok()) << server.status();
    servers_[g] = std::move(server).value();
  }
  expert::ExpertServer& server(int g) { return *servers_[g]; }
  const std::string& run_state_file(int g) const { return options_[g].run_state_file; }
  // `o` training on these services.
  TrainerOptions Remote(TrainerOptions o) const {
    o.remote_experts = true;
    o.expert_addresses = addresses_;
    return o;
  }

 private:
  std::vector<std::unique_ptr<expert::ExpertServer>> servers_;
  std::vector<expert::ExpertServerOptions> options_;
  std::vector<std::string> addresses_;
};

}  // namespace himoe::trainer::testing

#endif  // HIMOE_TESTS_TRAINER_TRAINER_TEST_UTIL_H_
