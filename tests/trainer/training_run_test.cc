// TrainingRun on a tiny in-process model: the run's files, a resumed run
// that goes on from the newest checkpoint, and refused flags.
#include "trainer/training_run.h"

#include <unistd.h>

#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/checkpoint_reader.h"
#include "tests/temp_dir.h"
#include "tests/trainer/trainer_test_util.h"

namespace himoe::trainer {
namespace {

using ::testing::HasSubstr;

TrainerFlags Tiny(const testing::TempDir& dir, const std::string& corpus) {
  TrainerFlags f;
  f.experts = "inprocess";
  f.data = corpus;
  f.format = "bytes";
  f.n_layer = 2;
  f.n_head = 2;
  f.d_model = 16;
  f.d_ff = 32;
  f.dense_ff = 32;
  f.block_size = 16;
  f.num_experts = 4;
  f.num_groups = 2;
  f.steps = 4;
  f.batch_size = 2;
  f.warmup = 1;
  f.eval_every = 2;
  f.eval_windows = 2;
  f.checkpoint_every = 2;
  f.out_dir = dir.Sub("run");
  return f;
}

TEST(TrainingRunTest, TrainsChecksAndResumes) {
  testing::TempDir dir;
  const std::string corpus = testing::WriteCorpus(dir);
  TrainerFlags flags = Tiny(dir, corpus);
  {
    absl::StatusOr<std::unique_ptr<TrainingRun>> run =
        TrainingRun::Create(flags, ComputeSetup(), nullptr);
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_FALSE((*run)->options().remote_experts);
    ASSERT_TRUE((*run)->Train().ok());
    EXPECT_EQ((*run)->trainer().step(), 4);
    EXPECT_EQ((*run)->stop_signal(), 0);
    EXPECT_GT((*run)->first_val(), 0);
    EXPECT_GT((*run)->last_val(), 0);
    ASSERT_TRUE((*run)->Report().ok());
  }
  const absl::StatusOr<std::string> latest =
      model::LatestCheckpoint(flags.out_dir + "/checkpoints");
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_TRUE(absl::EndsWith(*latest, model::CheckpointDirName(4))) << *latest;
  const std::string log = test_util::ReadTextFile(flags.out_dir + "/metrics.jsonl");
  EXPECT_THAT(log, HasSubstr("\"kind\":\"config\""));
  EXPECT_THAT(log, HasSubstr("\"kind\":\"eval\""));
  EXPECT_THAT(log, HasSubstr("\"kind\":\"memory\""));

  // Resumed: from step 4 to step 6, in the same run log.
  flags.resume = true;
  flags.steps = 6;
  absl::StatusOr<std::unique_ptr<TrainingRun>> resumed =
      TrainingRun::Create(flags, ComputeSetup(), nullptr);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  ASSERT_TRUE((*resumed)->Train().ok());
  EXPECT_EQ((*resumed)->trainer().step(), 6);
  EXPECT_THAT(test_util::ReadTextFile(flags.out_dir + "/metrics.jsonl"), HasSubstr("\"kind\":\"resume\""));
  EXPECT_TRUE(absl::EndsWith(*model::LatestCheckpoint(flags.out_dir + "/checkpoints"),
                             model::CheckpointDirName(6)));
}

TEST(TrainingRunTest, RefusesBadFlagsBeforeAnythingStarts) {
  testing::TempDir dir;
  TrainerFlags flags = Tiny(dir, testing::WriteCorpus(dir));
  flags.wire_dtype = "fp8";
  absl::StatusOr<std::unique_ptr<TrainingRun>> run =
      TrainingRun::Create(flags, ComputeSetup(), nullptr);
  EXPECT_EQ(run.status().message(), "--wire_dtype: expected float32 or bfloat16, got 'fp8'");
  EXPECT_NE(access(flags.out_dir.c_str(), F_OK), 0);  // nothing created

  flags = Tiny(dir, dir.Sub("missing.txt"));
  run = TrainingRun::Create(flags, ComputeSetup(), nullptr);
  ASSERT_TRUE(run.ok()) << run.status();  // the data is read when training starts
  EXPECT_FALSE((*run)->Train().ok());
}

}  // namespace
}  // namespace himoe::trainer
