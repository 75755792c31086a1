// TrainerFlags: what each flag becomes (hand-written expected values) and
// the messages of refused flags.
#include "trainer/trainer_flags.h"

#include <chrono>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace himoe::trainer {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TrainerFlags Inprocess() {
  TrainerFlags f;
  f.experts = "inprocess";
  f.data = "a.txt,,b.txt";
  return f;
}

std::string Refusal(const TrainerFlags& f) {
  return std::string(ValidateTrainerFlags(f).message());
}

TEST(TrainerFlagsTest, DefaultsAreAccepted) {
  EXPECT_TRUE(ValidateTrainerFlags(TrainerFlags()).ok());
  EXPECT_TRUE(ValidateTrainerFlags(Inprocess()).ok());
}

TEST(TrainerFlagsTest, OptionsFromFlags) {
  TrainerFlags f = Inprocess();
  f.n_layer = 2;
  f.n_head = 2;
  f.d_model = 32;
  f.d_ff = 64;
  f.dense_ff = 48;
  f.block_size = 16;
  f.moe_every = 2;
  f.steps = 7;
  f.batch_size = 3;
  f.grad_accum = 2;
  f.micro_batches_in_flight = 2;
  f.lr = 0.5;
  f.min_lr = 0.25;
  f.warmup = 4;
  f.weight_decay = 0.2;
  f.grad_clip = 0.5;
  f.eval_every = 5;
  f.eval_windows = 6;
  f.seed = 9;
  f.wire_dtype = "bfloat16";
  f.matmul_dtype = "bfloat16";
  f.format = "bytes";
  f.val_fraction = 0.2;
  const absl::StatusOr<TrainerOptions> o = TrainerOptionsFromFlags(f);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->model.n_layer, 2);
  EXPECT_EQ(o->model.n_head, 2);
  EXPECT_EQ(o->model.d_model, 32);
  EXPECT_EQ(o->model.d_ff, 64);
  EXPECT_EQ(o->model.dense_ff, 48);
  EXPECT_EQ(o->model.block_size, 16);
  EXPECT_EQ(o->model.moe_every, 2);
  EXPECT_EQ(o->model.seed, 9u);
  EXPECT_EQ(o->model.matmul_dtype, v1::DTYPE_BFLOAT16);
  EXPECT_EQ(o->model.init, v1::WEIGHT_INIT_DEFAULT);  // the paper preset's
  EXPECT_THAT(o->data.paths, ElementsAre("a.txt", "b.txt"));
  EXPECT_EQ(o->data.format, "bytes");
  EXPECT_EQ(o->data.val_fraction, 0.2);
  EXPECT_EQ(o->steps, 7);
  EXPECT_EQ(o->batch_size, 3);
  EXPECT_EQ(o->grad_accum, 2);
  EXPECT_EQ(o->micro_batches_in_flight, 2);
  EXPECT_EQ(o->lr, 0.5);
  EXPECT_EQ(o->min_lr, 0.25);
  EXPECT_EQ(o->warmup_steps, 4);
  EXPECT_EQ(o->weight_decay, 0.2);
  EXPECT_EQ(o->grad_clip, 0.5);
  EXPECT_EQ(o->eval_every, 5);
  EXPECT_EQ(o->eval_windows, 6);
  EXPECT_EQ(o->seed, 9u);
  EXPECT_EQ(o->experts_mode, "inprocess");
  EXPECT_EQ(o->wire_dtype, c10::kBFloat16);
  EXPECT_FALSE(o->remote_experts);  // placed by TrainingRun

  f.profile = true;  // the profiler follows one thread
  EXPECT_EQ(TrainerOptionsFromFlags(f)->micro_batches_in_flight, 1);
  f.profile = false;

  // Remote experts split an even batch in two by default; in process, an odd
  // batch, or a profiled step keep it whole; --split_batch says otherwise.
  f.batch_size = 4;
  for (const auto& [experts, batch, accum] :
       {std::tuple{"inprocess", 4, 2}, std::tuple{"local", 2, 4}, std::tuple{"cluster", 2, 4}}) {
    f.experts = experts;
    f.cluster = f.experts == "cluster" ? "cluster.textproto" : "";
    const absl::StatusOr<TrainerOptions> split = TrainerOptionsFromFlags(f);
    ASSERT_TRUE(split.ok()) << split.status();
    EXPECT_EQ(split->batch_size, batch) << experts;
    EXPECT_EQ(split->grad_accum, accum) << experts;
  }
  f.experts = "local";
  f.cluster.clear();
  f.profile = true;
  EXPECT_EQ(TrainerOptionsFromFlags(f)->batch_size, 4);
  f.profile = false;
  f.batch_size = 3;
  EXPECT_EQ(TrainerOptionsFromFlags(f)->batch_size, 3);
  f.batch_size = 4;
  f.split_batch = 4;
  EXPECT_EQ(TrainerOptionsFromFlags(f)->batch_size, 1);
  EXPECT_EQ(TrainerOptionsFromFlags(f)->grad_accum, 8);
  f.split_batch = 3;
  const absl::StatusOr<TrainerOptions> bad = TrainerOptionsFromFlags(f);
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status()));
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("--split_batch: 3; expected 0 (automatic) or a divisor of --batch_size=4"));
  f.split_batch = 0;
  f.experts = "inprocess";
  f.preset = "reference";  // its init, unless --init says
  EXPECT_EQ(TrainerOptionsFromFlags(f)->model.init, v1::WEIGHT_INIT_SWITCH);
  f.init = "default";
  EXPECT_EQ(TrainerOptionsFromFlags(f)->model.init, v1::WEIGHT_INIT_DEFAULT);
}

TEST(TrainerFlagsTest, RoutingFromFlags) {
  TrainerFlags f = Inprocess();
  f.method = "himoe";
  f.num_experts = 8;
  f.num_groups = 2;
  f.top_k = 2;
  f.temperature = 0.5;
  f.tau = 0.02;
  f.lambda_intra = 0.3;
  f.capacity_factor = 1.5;
  absl::StatusOr<router::RoutingConfig> c = RoutingConfigFromFlags(f);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->method, router::RoutingMethod::kHiMoe);
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->num_groups, 2);
  EXPECT_EQ(c->top_k, 2);
  EXPECT_EQ(c->temperature, 0.5);
  EXPECT_EQ(c->tau, 0.02);
  EXPECT_EQ(c->lambda_intra, 0.3);
  EXPECT_EQ(c->capacity_factor, 1.5);
  // -1: himoe's own defaults of the controllers.
  EXPECT_EQ(c->target_expert_cv, 0.1);
  EXPECT_EQ(c->epsilon_ov, 0.8);
  EXPECT_EQ(c->epsilon_sys, 0.3);

  f.method = "vanilla";
  f.capacity_factor = -1;  // the preset's: paper = dropless
  c = RoutingConfigFromFlags(f);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->capacity_factor, 0.0);
  EXPECT_EQ(c->target_expert_cv, 0.0);
  EXPECT_EQ(c->epsilon_ov, 0.0);

  f.method = "fancy";
  EXPECT_THAT(std::string(RoutingConfigFromFlags(f).status().message()),
              HasSubstr("method 'fancy' is unknown"));
  f.method = "himoe";
  f.top_k = 5;  // more than N/M
  EXPECT_THAT(std::string(TrainerOptionsFromFlags(f).status().message()), HasSubstr("top_k"));
}

TEST(TrainerFlagsTest, BadFlagsAreNamed) {
  TrainerFlags f = Inprocess();
  f.wire_dtype = "fp8";
  EXPECT_EQ(Refusal(f), "--wire_dtype: expected float32 or bfloat16, got 'fp8'");
  EXPECT_EQ(TrainerOptionsFromFlags(f).status().code(), absl::StatusCode::kInvalidArgument);

  f = Inprocess();
  f.experts = "remote";
  EXPECT_EQ(Refusal(f), "--experts: expected local, cluster or inprocess, got 'remote'");
  f.experts = "cluster";
  EXPECT_EQ(Refusal(f), "--cluster: a cluster file is needed with --experts=cluster");

  f = Inprocess();
  f.expert_metrics_port = 9465;
  EXPECT_THAT(Refusal(f), HasSubstr("--expert_metrics_port: a port >= 0, or -1, and only with "
                                    "--experts=local"));
  f.experts = "local";
  EXPECT_TRUE(ValidateTrainerFlags(f).ok());
  f.expert_metrics_port = -2;
  EXPECT_THAT(Refusal(f), HasSubstr("--expert_metrics_port"));

  f = Inprocess();
  f.group_run_state = true;
  EXPECT_THAT(Refusal(f), HasSubstr("--group_run_state: only with --experts=local"));
  f.experts = "local";
  EXPECT_TRUE(ValidateTrainerFlags(f).ok());

  f = Inprocess();
  f.matmul_dtype = "fp16";
  EXPECT_EQ(Refusal(f), "--matmul_dtype: expected float32 or bfloat16, got 'fp16'");
  f = Inprocess();
  f.init = "fancy";
  EXPECT_EQ(Refusal(f), "--init: expected default or switch, got 'fancy'");
  f = Inprocess();
  f.on_group_failure = "retry";
  EXPECT_EQ(Refusal(f), "--on_group_failure: expected fail or wait_and_resume, got 'retry'");
  f = Inprocess();
  f.eval_every = 0;
  EXPECT_EQ(Refusal(f), "--eval_every: expected a step count >= 1, got '0'");
  f = Inprocess();
  f.log_every = 0;
  EXPECT_EQ(Refusal(f), "--log_every: expected a step count >= 1, got '0'");
  f = Inprocess();
  f.keep_checkpoints = 0;
  EXPECT_EQ(Refusal(f), "--keep_checkpoints: expected a count >= 1, got '0'");
}

TEST(TrainerFlagsTest, OnGroupFailureByMode) {
  TrainerFlags f;
  f.experts = "local";
  EXPECT_TRUE(WaitAndResume(f));
  f.experts = "cluster";
  EXPECT_FALSE(WaitAndResume(f));
  f.on_group_failure = "wait_and_resume";
  EXPECT_TRUE(WaitAndResume(f));
  f.experts = "inprocess";  // nothing to wait for
  EXPECT_FALSE(WaitAndResume(f));
  f.experts = "local";
  f.on_group_failure = "fail";
  EXPECT_FALSE(WaitAndResume(f));
}

// Sets environment variables for a scope, then restores them.
class ScopedEnv {
 public:
  explicit ScopedEnv(std::initializer_list<std::pair<std::string, std::string>> vars) {
    for (const auto& [name, value] : vars) {
      const char* old = std::getenv(name.c_str());
      saved_.emplace_back(
          name, old == nullptr ? std::optional<std::string>() : std::optional<std::string>(old));
      setenv(name.c_str(), value.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, old] : saved_) {
      if (old.has_value()) {
        setenv(name.c_str(), old->c_str(), 1);
      } else {
        unsetenv(name.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST(TrainerFlagsTest, RanksFromTorchrunEnvironmentAndFlags) {
  TrainerFlags f;
  f.experts = "inprocess";
  {
    const ScopedEnv env({{"RANK", "1"},
                         {"WORLD_SIZE", "3"},
                         {"MASTER_ADDR", "10.0.0.7"},
                         {"MASTER_PORT", "29611"},
                         {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
    absl::StatusOr<DataParallelOptions> o = DataParallelOptionsFromFlags(f);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->rank, 1);
    EXPECT_EQ(o->world_size, 3);
    EXPECT_EQ(o->master_addr, "10.0.0.7");
    EXPECT_EQ(o->master_port, 29611);
    EXPECT_TRUE(o->store_hosted);
    EXPECT_EQ(o->timeout, std::chrono::seconds(300));
    // The flags win over the environment.
    f.rank = 2;
    f.master_addr = "127.0.0.1";
    f.master_port = 0;
    f.dist_timeout_s = 9;
    o = DataParallelOptionsFromFlags(f);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_EQ(o->rank, 2);
    EXPECT_EQ(o->master_addr, "127.0.0.1");
    EXPECT_EQ(o->master_port, 0);
    EXPECT_EQ(o->timeout, std::chrono::seconds(9));
    f.rank = 3;
    EXPECT_THAT(std::string(DataParallelOptionsFromFlags(f).status().message()),
                HasSubstr("--rank: 3 is not below the world size 3"));
    f.rank = -1;
    f.experts = "local";
    EXPECT_THAT(std::string(DataParallelOptionsFromFlags(f).status().message()),
                HasSubstr("--experts=local: each of the 3 ranks would start its own expert"));
    f.expert_addresses = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3,127.0.0.1:4";
    EXPECT_TRUE(DataParallelOptionsFromFlags(f).ok());
    f.expert_addresses = "";
    f.experts = "cluster";
    f.on_group_failure = "wait_and_resume";
    EXPECT_THAT(std::string(DataParallelOptionsFromFlags(f).status().message()),
                HasSubstr("with more than one rank a failed group ends the run"));
    f.on_group_failure = "";
    EXPECT_TRUE(DataParallelOptionsFromFlags(f).ok());
    f.experts = "local";
  }
  {
    const ScopedEnv env({{"WORLD_SIZE", "two"}});
    EXPECT_THAT(std::string(DataParallelOptionsFromFlags(f).status().message()),
                HasSubstr("environment variable WORLD_SIZE: expected an integer in [1, 65536], "
                          "got 'two'"));
  }
  const ScopedEnv none(
      {{"RANK", ""}, {"WORLD_SIZE", ""}, {"MASTER_ADDR", ""}, {"MASTER_PORT", ""}});
  absl::StatusOr<DataParallelOptions> alone = DataParallelOptionsFromFlags(TrainerFlags());
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(alone->world_size, 1);
  EXPECT_EQ(alone->rank, 0);
  EXPECT_EQ(alone->master_port, 29500);
}

TEST(TrainerFlagsTest, ComputeOptions) {
  TrainerFlags f = Inprocess();
  f.threads = 3;
  f.gemm_gflops = 12.5;
  f.blas_probe = false;
  f.split_products = false;
  f.matmul_dtype = "bfloat16";
  absl::StatusOr<ComputeOptions> c = ComputeOptionsFromFlags(f);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->threads, 3);
  EXPECT_EQ(c->gemm_gflops, 12.5);
  EXPECT_EQ(c->gemm_threads, 0);
  EXPECT_FALSE(c->probe_kernels);
  EXPECT_FALSE(c->split_products);
  EXPECT_TRUE(c->bf16_products);

  // Local experts: the coordinator takes the cores its processes leave (at
  // least one), and MFU is against all of them.
  f.experts = "local";
  f.threads = 0;
  f.num_groups = 1000;
  c = ComputeOptionsFromFlags(f);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->threads, 1);
  EXPECT_GE(c->gemm_threads, 1);

  f.experts = "cluster";
  f.cluster = "/nonexistent/cluster.textproto";
  EXPECT_FALSE(ComputeOptionsFromFlags(f).ok());
}

}  // namespace
}  // namespace himoe::trainer
