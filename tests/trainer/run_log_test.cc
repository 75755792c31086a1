// metrics.jsonl across a resume: the resumed run's lines replace the ones the
// interrupted run wrote after its checkpoint, so no step is counted twice.
#include "trainer/run_log.h"

#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/trainer/trainer_test_util.h"

namespace himoe::trainer {
namespace {

// (kind, step) of every line; step -1 where the line has no integer step.
std::vector<std::pair<std::string, int64_t>> Lines(const std::string& path) {
  std::vector<std::pair<std::string, int64_t>> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto rec = nlohmann::json::parse(line);
    const bool has_step = rec.contains("step") && rec["step"].is_number_integer();
    out.emplace_back(rec.value("kind", ""), has_step ? rec["step"].get<int64_t>() : -1);
  }
  return out;
}

void WriteSteps(RunLog& log, int64_t first, int64_t last, int eval_every) {
  for (int64_t step = first; step <= last; ++step) {
    StepResult s;
    s.step = step;
    s.tokens = 64;
    s.seconds = 0.01;
    log.OnStep(s);
    if (step % eval_every == 0) log.OnEval(step, EvalResult{2.0, {}});
  }
}

TEST(RunLogTest, AResumedRunDropsWhatFollowedItsCheckpoint) {
  testing::TempDir dir("himoe_run_log_test");
  const std::string path = dir.path() + "/metrics.jsonl";
  v1::RunConfig config;
  config.set_step(0);
  {
    // Evaluates at 0, 2, 4; checkpoint at 4; stopped after step 5.
    auto log = RunLog::Create(path, /*total_steps=*/8, /*window=*/4);
    ASSERT_TRUE(log.ok()) << log.status();
    (*log)->OnConfig(config);
    (*log)->OnEval(0, EvalResult{3.0, {}});
    WriteSteps(**log, 1, 5, 2);
  }
  {
    auto log = RunLog::Create(path, 8, 4, /*resumed_at=*/4);
    ASSERT_TRUE(log.ok()) << log.status();
    config.set_step(4);
    (*log)->OnConfig(config);
    (*log)->OnEval(4, EvalResult{1.9, {}});  // the resumed run evaluates first
    WriteSteps(**log, 5, 8, 2);
  }
  const std::vector<std::pair<std::string, int64_t>> want = {
      {"config", -1}, {"eval", 0},  {"train", 1}, {"train", 2}, {"eval", 2},
      {"train", 3},   {"train", 4}, {"resume", -1}, {"eval", 4},  {"train", 5},
      {"train", 6},   {"eval", 6},  {"train", 7}, {"train", 8},  {"eval", 8}};
  EXPECT_EQ(Lines(path), want);
  // A new run starts the file again.
  auto fresh = RunLog::Create(path, 8, 4);
  ASSERT_TRUE(fresh.ok());
  (*fresh)->OnConfig(config);
  EXPECT_EQ(Lines(path), (std::vector<std::pair<std::string, int64_t>>{{"config", -1}}));
}

// Hand sums: 2e9 model FLOPs in 0.5 s is 4 GFLOP/s, 40% of a 10 GFLOP/s
// machine. Without a machine rate (experts on a GPU or another host) no MFU
// is written or shown rather than 0 or a share of the wrong machine.
TEST(RunLogTest, MfuOnlyAgainstAKnownMachineRate) {
  testing::TempDir dir("himoe_run_log_mfu_test");
  for (const double machine : {10.0, 0.0}) {
    const std::string path = dir.path() + "/metrics.jsonl";
    auto log = RunLog::Create(path, /*total_steps=*/2, /*window=*/4);
    ASSERT_TRUE(log.ok()) << log.status();
    StepResult s;
    s.step = 1;
    s.tokens = 1000;
    s.seconds = 0.5;
    s.flops = 2e9;
    s.machine_gflops = machine;
    (*log)->OnStep(s);
    std::ifstream in(path);
    std::string line;
    ASSERT_TRUE(std::getline(in, line));
    const auto rec = nlohmann::json::parse(line);
    EXPECT_DOUBLE_EQ(rec.at("gflops").get<double>(), 4.0);
    if (machine > 0) {
      EXPECT_DOUBLE_EQ(rec.at("mfu").get<double>(), 0.4);
      EXPECT_NE((*log)->ProgressLine().find("| MFU 40% |"), std::string::npos)
          << (*log)->ProgressLine();
    } else {
      EXPECT_FALSE(rec.contains("mfu")) << line;
      EXPECT_EQ((*log)->ProgressLine().find("MFU"), std::string::npos) << (*log)->ProgressLine();
    }
  }
}

// 4 steps in 2 s on 2 cores: 0.4 s of the coordinator is 100 ms a step, 0.2
// and 0.6 s of two expert processes 50 and 150; 1.2 of 4 core-seconds used.
TEST(RunLogTest, CpuLinePerStepAndTheCoresShareUsed) {
  testing::TempDir dir("himoe_run_log_cpu_test");
  const std::string path = dir.path() + "/metrics.jsonl";
  auto log = RunLog::Create(path, /*total_steps=*/4, /*window=*/4);
  ASSERT_TRUE(log.ok()) << log.status();
  const std::string text = (*log)->OnCpu(/*steps=*/4, /*wall_seconds=*/2.0, /*cores=*/2,
                                         /*coordinator_seconds=*/0.4, {0.2, 0.6});
  EXPECT_EQ(text,
            "CPU per step over 4 steps: coordinator 100.0 core-ms, expert processes 50.0, "
            "150.0 core-ms; 30% of 2 cores' 1000.0 core-ms");
  std::ifstream in(path);
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const auto rec = nlohmann::json::parse(line);
  EXPECT_EQ(rec.at("kind"), "cpu");
  EXPECT_EQ(rec.at("steps").get<int64_t>(), 4);
  EXPECT_EQ(rec.at("cores").get<int>(), 2);
  EXPECT_DOUBLE_EQ(rec.at("wall_s").get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(rec.at("coordinator_core_ms_per_step").get<double>(), 100.0);
  EXPECT_EQ(rec.at("expert_core_ms_per_step").get<std::vector<double>>(),
            (std::vector<double>{50.0, 150.0}));
  EXPECT_DOUBLE_EQ(rec.at("used_fraction").get<double>(), 0.3);
}

}  // namespace
}  // namespace himoe::trainer
