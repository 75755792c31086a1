#ifndef HIMOE_TRAINER_TRAINER_FLAGS_H_
#define HIMOE_TRAINER_TRAINER_FLAGS_H_

// himoe-trainer's command line as values (trainer_main.cc defines the flags
// and fills a TrainerFlags), checked, and turned into the options of the
// pieces it sets up: compute, the trainer, the run.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/compute_setup.h"
#include "common/tls_files.h"
#include "model/model_config.h"
#include "trainer/data_parallel.h"
#include "trainer/trainer.h"

namespace himoe::trainer {

// Every himoe-trainer flag; the defaults are the flags'.
struct TrainerFlags {
  // Where the experts run and what they train on.
  std::string experts = "local";  // local | cluster | inprocess
  // With --experts=local: the groups' addresses, comma-separated, when they
  // already run (the launcher of the ranks started them); empty = start them.
  std::string expert_addresses;
  std::string cluster;
  std::string data;  // comma-separated; empty = the fortunes corpus
  std::string format = "auto";
  double val_fraction = 0.1;
  // Routing.
  std::string method = "himoe";
  std::string preset = "paper";
  std::string init;  // empty = the preset's
  double temperature = 1.0;
  double tau = 0.01;
  double ema_beta = 0.9;
  double lambda_intra = 0.1;
  double lambda_inter = 0.05;
  double alpha = 0.01;
  double z_coef = 0.001;
  double capacity_factor = -1;   // -1 = the preset's
  double target_expert_cv = -1;  // -1 = the method's default
  double balance_rate = 0.1;
  double epsilon_ov = -1;   // -1 = the method's default
  double epsilon_sys = -1;  // -1 = the method's default
  double dual_rate = 0.01;
  int num_experts = 8;
  int num_groups = 4;
  int top_k = 1;
  // The model.
  int n_layer = 4;
  int n_head = 4;
  int64_t d_model = 128;
  int64_t d_ff = 256;
  int64_t dense_ff = 512;
  int64_t block_size = 64;
  int moe_every = 1;
  // Training.
  int64_t steps = 600;
  int64_t batch_size = 16;
  int grad_accum = 1;
  // Each micro-batch runs as this many of batch_size / split_batch sequences;
  // 0 = 2 with remote experts (local, cluster) when batch_size is even and
  // the step is not profiled, else 1.
  int split_batch = 0;
  int micro_batches_in_flight = 2;
  double lr = 2e-3;
  double min_lr = 2e-4;
  int64_t warmup = 30;
  double weight_decay = 0.1;
  double grad_clip = 1.0;
  int64_t eval_every = 100;
  int64_t eval_windows = 64;
  uint64_t seed = 1;
  // Compute and the wire.
  int threads = 0;
  std::string wire_dtype = "float32";
  std::string matmul_dtype = "float32";
  bool shared_memory = true;
  bool take_over_served_experts = false;
  int expert_threads = 1;
  bool blas_probe = true;
  bool split_products = true;
  bool profile = false;
  bool profile_ops = false;
  double gemm_gflops = 0;
  // Output, metrics, checkpoints, failures.
  std::string out_dir = "runs/latest";
  int metrics_port = -1;
  int expert_metrics_port = -1;
  int64_t checkpoint_every = 0;
  int keep_checkpoints = 3;
  bool resume = false;
  std::string on_group_failure;  // empty = by --experts
  int max_group_restarts = 3;
  // wait_and_resume: when every group kept its state, run the failed step
  // again instead of reloading the last checkpoint.
  bool retry_failed_step = true;
  // --experts=local: each group keeps its run in <out_dir>/experts/
  // expert-<g>.run (himoe-expert --run_state_file).
  bool group_run_state = false;
  TlsFiles tls;
  int group_wait_s = 300;
  int group_keepalive_ms = 2000;
  int64_t log_every = 10;
  // Data parallel: this process's rank of world_size; -1 / 0 = the
  // torchrun environment's (RANK, WORLD_SIZE), else 0 of 1. The rendezvous
  // at master_addr:master_port (empty / -1 = MASTER_ADDR, MASTER_PORT, else
  // 127.0.0.1:29500).
  int rank = -1;
  int world_size = 0;
  // > 1: this process starts that many ranks of itself (and, with
  // --experts=local, their expert processes) and waits for them.
  int ranks = 1;
  std::string master_addr;
  int master_port = -1;
  int dist_timeout_s = 300;
};

// InvalidArgument naming the flag for what is refused before anything
// starts: --experts, --cluster (needed with --experts=cluster),
// --expert_metrics_port, --wire_dtype, --matmul_dtype, --init,
// --on_group_failure, --log_every, --keep_checkpoints, --max_group_restarts,
// --group_wait_s, --group_keepalive_ms. The model and routing values are checked by
// TrainerOptionsFromFlags.
absl::Status ValidateTrainerFlags(const TrainerFlags& flags);

// --on_group_failure resolved: true for wait_and_resume (the default with
// --experts=local; never in process, nor with more than one rank), false
// for fail.
bool WaitAndResume(const TrainerFlags& flags);

// The routing settings: the method, the preset, then every value given.
absl::StatusOr<router::RoutingConfig> RoutingConfigFromFlags(const TrainerFlags& flags);

// The trainer's options before the experts are placed (TrainingRun places
// them): model, routing, data, schedule, wire.
absl::StatusOr<TrainerOptions> TrainerOptionsFromFlags(const TrainerFlags& flags);

// Where this process sits among the trainer ranks: the flags over the
// torchrun environment; an error naming the flag or variable that is out of
// range.
absl::StatusOr<DataParallelOptions> DataParallelOptionsFromFlags(const TrainerFlags& flags);

// How this process sets up compute: --threads (0 = the cores the local
// expert processes, or the cluster file's services on this host, leave), the
// GEMM-rate probe against the cores the run uses, the kernel probe and cache.
// Reads the cluster file with --experts=cluster.
absl::StatusOr<ComputeOptions> ComputeOptionsFromFlags(const TrainerFlags& flags);

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_TRAINER_FLAGS_H_
