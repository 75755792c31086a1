// himoe-trainer: trains a Hi-MoE LM; dense parts and routers here, experts on
// expert-group services (spawned locally, or listed in a cluster file) or in
// this process.
#include <cstdint>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/exposer.h>
#include <prometheus/registry.h>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/compute_setup.h"
#include "common/metrics_endpoint.h"
#include "common/service_main.h"
#include "common/status_macros.h"
#include "router_service/routing/routing_config.h"
#include "trainer/rank_launcher.h"
#include "trainer/trainer_flags.h"
#include "trainer/training_run.h"

ABSL_FLAG(std::string, experts, "local",
          "where the experts run: local (spawn M himoe-expert processes on 127.0.0.1), "
          "cluster (the services of --cluster), or inprocess");
ABSL_FLAG(std::string, expert_addresses, "",
          "with --experts=local: the groups' addresses (host:port, comma-separated, in group "
          "order) when they already run; empty = start them");
ABSL_FLAG(std::string, cluster, "", "cluster file (with --experts=cluster)");
ABSL_FLAG(std::string, data, "",
          "comma-separated files/directories; default: the fortunes corpus");
ABSL_FLAG(std::string, format, "auto", "bytes | nanogpt | auto");
ABSL_FLAG(double, val_fraction, 0.1, "bytes format: share of each file held out");
ABSL_FLAG(std::string, method, "himoe", "vanilla | st_moe | loss_free | moge | himoe");
ABSL_FLAG(std::string, preset, "paper", "paper | reference");
ABSL_FLAG(std::string, init, "",
          "fresh weights: default (nanoGPT's N(0, 0.02), nn.Linear's for the experts) | switch "
          "(the released code's truncated normal, scale 0.1); empty = the preset's (reference: "
          "switch)");
ABSL_FLAG(double, temperature, 1.0, "T of softmax((g - tau gbar)/T)");
ABSL_FLAG(double, tau, 0.01, "bias-correction strength");
ABSL_FLAG(double, ema_beta, 0.9, "EMA factor of the router logits");
ABSL_FLAG(double, lambda_intra, 0.1, "R_intra weight");
ABSL_FLAG(double, lambda_inter, 0.05, "R_inter weight");
ABSL_FLAG(double, alpha, 0.01, "load-loss weight");
ABSL_FLAG(double, z_coef, 0.001, "z-loss weight (st_moe)");
ABSL_FLAG(double, capacity_factor, -1, "expert capacity factor; -1 = the preset's");
ABSL_FLAG(double, target_expert_cv, -1,
          "balance controller: hold every layer's expert load CV at or under this; "
          "-1 = the method's default (0.1 for himoe, off for the others), 0 = off");
ABSL_FLAG(double, balance_rate, 0.1,
          "balance controller: dual-ascent step, in logits per unit of load violation");
ABSL_FLAG(double, epsilon_ov, -1,
          "himoe: dual ascent of lambda_intra in [0, --lambda_intra] on the routing "
          "overlap C_ov = mean(1 - ||pi||^2) <= this; -1 = the method's default (0.8 "
          "for himoe), 0 = off (fixed lambda_intra, as in the paper's experiments)");
ABSL_FLAG(double, epsilon_sys, -1,
          "himoe: dual ascent of lambda_inter in [0, --lambda_inter] on C_sys = "
          "mean ||pi_tilde||^2 <= this; -1 = the method's default (0.3 for himoe), "
          "0 = off (fixed lambda_inter)");
ABSL_FLAG(double, dual_rate, 0.01,
          "step of the dual ascent on lambda_intra and lambda_inter, per unit of "
          "constraint violation and training batch");
ABSL_FLAG(int, num_experts, 8, "N");
ABSL_FLAG(int, num_groups, 4, "M (one expert process each)");
ABSL_FLAG(int, top_k, 1, "k experts per group");
ABSL_FLAG(int, n_layer, 4, "transformer layers");
ABSL_FLAG(int, n_head, 4, "attention heads");
ABSL_FLAG(int64_t, d_model, 128, "model width");
ABSL_FLAG(int64_t, d_ff, 256, "expert hidden width");
ABSL_FLAG(int64_t, dense_ff, 512, "dense FFN hidden width");
ABSL_FLAG(int64_t, block_size, 64, "context length");
ABSL_FLAG(int, moe_every, 1, "MoE FFN on every layer (1) or every other layer (2)");
ABSL_FLAG(int64_t, steps, 600, "optimizer steps");
ABSL_FLAG(int64_t, batch_size, 16, "sequences per micro-batch");
ABSL_FLAG(int, grad_accum, 1, "micro-batches per step");
ABSL_FLAG(int, split_batch, 0,
          "each micro-batch of --batch_size sequences runs as this many micro-batches of "
          "batch_size / N (gradients summed over all of them), so that with remote experts one's "
          "dense work overlaps another's expert traffic; 0 = 2 with remote experts (local, "
          "cluster) and an even --batch_size, 1 in process");
ABSL_FLAG(int, micro_batches_in_flight, 2,
          "with remote experts and more than one micro-batch a step (--grad_accum x "
          "--split_batch): micro-batches run this many at once, one's dense work beside another's "
          "expert calls (the step is the sequential one, bit for bit; each holds its "
          "activations); 1 = one at a time");
ABSL_FLAG(double, lr, 2e-3, "peak learning rate");
ABSL_FLAG(double, min_lr, 2e-4, "final learning rate");
ABSL_FLAG(int64_t, warmup, 30, "warmup steps");
ABSL_FLAG(double, weight_decay, 0.1, "AdamW weight decay (matrices only)");
ABSL_FLAG(double, grad_clip, 1.0, "global grad-norm clip over all shards; 0 = off");
ABSL_FLAG(int64_t, eval_every, 100, "validation every N steps");
ABSL_FLAG(int64_t, eval_windows, 64, "validation windows of block_size tokens");
ABSL_FLAG(uint64_t, seed, 1, "seed of weights and batches");
ABSL_FLAG(std::string, wire_dtype, "float32",
          "the experts' rows, outputs and gradients between this process and the groups: "
          "float32 (exact) | bfloat16 (half the bytes, each crossing rounded; the experts "
          "still compute in float32; --experts=inprocess makes the same roundings)");
ABSL_FLAG(std::string, matmul_dtype, "float32",
          "the products of the experts and the attention projections: float32, or bfloat16 "
          "(operands rounded to bfloat16, sums in float32, as torch's matmul precision "
          "'medium'; weights, gradients and optimizer state stay float32; twice the GEMM rate "
          "on CPUs with AVX512_BF16)");
ABSL_FLAG(bool, shared_memory, true,
          "with --experts=local: the rows, outputs and gradients go through POSIX shared "
          "memory (/dev/shm; gRPC carries references); false: inside the gRPC messages");
ABSL_FLAG(bool, take_over_served_experts, false,
          "begin the run even on groups that serve a model a router loaded (the router then "
          "refuses their answers); without it such a cluster is refused at start");
ABSL_FLAG(int, expert_threads, 1, "torch threads per spawned expert process");
ABSL_FLAG(bool, split_products, true,
          "with more than one thread: compute a group's experts side by side, each product on "
          "one thread, instead of one after another with each product split across the "
          "threads");
ABSL_FLAG(bool, profile, false,
          "time each step by category (attention, routing, experts, RPC, optimizer, ...), after "
          "3 warm-up steps; prints a table at the end and writes <out_dir>/profile.md; the "
          "micro-batches then run one at a time");
ABSL_FLAG(bool, profile_ops, false,
          "with --profile: also time every outermost LibTorch op and autograd node (the "
          "callbacks slow the step)");
ABSL_FLAG(double, gemm_gflops, 0,
          "the machine's GEMM rate in GFLOP/s that MFU is measured against (fp32, or bf16 "
          "operands under --matmul_dtype=bfloat16); 0 = measure it at start (0.3 s), -1 = no "
          "MFU");
ABSL_FLAG(std::string, out_dir, "runs/latest", "metrics.jsonl and logs go here");
ABSL_FLAG(int, expert_metrics_port, -1,
          "with --experts=local: Prometheus /metrics of group g's process on 127.0.0.1:N+g "
          "(9465 = deploy/prometheus/prometheus.yml's targets); 0 picks ports; -1 = off");
ABSL_FLAG(int64_t, checkpoint_every, 0,
          "checkpoint every N steps (and at the end, and on SIGINT/SIGTERM/SIGHUP); 0 = off");
ABSL_FLAG(int, keep_checkpoints, 3, "checkpoints kept (the newest)");
ABSL_FLAG(bool, resume, false, "resume from the newest checkpoint in <out_dir>/checkpoints");
ABSL_FLAG(std::string, on_group_failure, "",
          "when an expert group fails (UNAVAILABLE or DEADLINE_EXCEEDED): fail, or "
          "wait_and_resume (abort the step, wait for the group to serve again, restarting it "
          "with --experts=local, then run the step again if every group kept its state, else "
          "reload the last checkpoint, or step 0 without one, and go on); "
          "empty = wait_and_resume with --experts=local, fail otherwise");
ABSL_FLAG(int, max_group_restarts, 3, "group failures wait_and_resume recovers from, then fails");
ABSL_FLAG(bool, retry_failed_step, true,
          "wait_and_resume: when every group kept its state (a stalled process, a cut link, "
          "reset connections, a restart on its run state file), run the failed step again "
          "instead of reloading the last checkpoint and redoing the steps since");
ABSL_FLAG(bool, group_run_state, false,
          "--experts=local: each group keeps its training run in "
          "<out_dir>/experts/expert-<g>.run (himoe-expert --run_state_file, rewritten after "
          "every step), so a group restarted after it died serves the run again and the failed "
          "step runs again in place; costs a copy and a write of each group's weights and AdamW "
          "state a step (docs/benchmarks.md)");
ABSL_FLAG(int, group_wait_s, 300,
          "wait_and_resume: seconds to wait for the groups to serve again");
ABSL_FLAG(int, group_keepalive_ms, 2000,
          "remote experts: ping every group's connection this often, and ask a group's health "
          "service once a call to it is this old; fail the calls of a group whose ping or health "
          "check is not answered within as long again (a stopped process, a cut or stalled link: "
          "UNAVAILABLE, which --on_group_failure handles); 0 = off, the 60 s call deadline alone");
ABSL_FLAG(int64_t, log_every, 10, "progress line every N steps when not on a terminal");
ABSL_FLAG(int, rank, -1,
          "data parallel: this process's rank; -1 = $RANK, else 0. Rank 0 evaluates, "
          "checkpoints and prints the progress; each rank trains on its share of every step's "
          "batches");
ABSL_FLAG(int, world_size, 0, "data parallel: the number of ranks; 0 = $WORLD_SIZE, else 1");
ABSL_FLAG(std::string, master_addr, "",
          "data parallel: the rendezvous host (c10d TCPStore, served by rank 0 unless "
          "$TORCHELASTIC_USE_AGENT_STORE); empty = $MASTER_ADDR, else 127.0.0.1");
ABSL_FLAG(int, master_port, -1,
          "data parallel: the rendezvous port; -1 = $MASTER_PORT, else 29500");
ABSL_FLAG(int, ranks, 1,
          "data parallel on this host: start this many ranks of himoe-trainer (and, with "
          "--experts=local, one set of expert processes they share), serve their rendezvous, "
          "follow rank 0's log and wait for them, as torchrun does; under "
          "--on_group_failure=wait_and_resume a lost expert process is restarted and every "
          "rank resumes from the newest checkpoint");
ABSL_FLAG(int, dist_timeout_s, 300,
          "data parallel: seconds the rendezvous and each collective wait for the other ranks");

namespace himoe::trainer {
namespace {

ServiceInfo Info() {
  ServiceInfo info;
  info.name = "himoe-trainer";
  info.usage =
      "Trains a Hi-MoE language model; dense layers and routers here, experts on expert-group "
      "services or in this process.\n"
      "Usage: himoe-trainer [--experts=local|cluster|inprocess] [--cluster=FILE] "
      "[--data=PATHS] [--out_dir=DIR] [flags]";
  ServiceFlagHelp& help = info.flag_help;
  help.threads =
      "torch and BLAS threads of this process; 0 = all cores, or with --experts=local, or "
      "--experts=cluster with services on this host, the cores they leave (at least 1)";
  help.blas_probe =
      "with BLIS and no BLIS_ARCH_TYPE set: time the kernel sets this CPU supports and keep "
      "the fastest (spawned expert processes inherit the choice)";
  help.metrics_port = "Prometheus /metrics port; 0 picks one, -1 = off";
  help.tls_ca =
      "mutual TLS to the expert services: PEM of the CA that signs every peer (with "
      "--tls_cert, --tls_key). --experts=local starts its services with them too; "
      "--experts=cluster: all empty = the cluster file's tls, or plaintext";
  return info;
}

// --experts ... --moe_every.
void ReadModelFlags(TrainerFlags& f) {
  f.experts = absl::GetFlag(FLAGS_experts);
  f.expert_addresses = absl::GetFlag(FLAGS_expert_addresses);
  f.cluster = absl::GetFlag(FLAGS_cluster);
  f.data = absl::GetFlag(FLAGS_data);
  f.format = absl::GetFlag(FLAGS_format);
  f.val_fraction = absl::GetFlag(FLAGS_val_fraction);
  f.method = absl::GetFlag(FLAGS_method);
  f.preset = absl::GetFlag(FLAGS_preset);
  f.init = absl::GetFlag(FLAGS_init);
  f.temperature = absl::GetFlag(FLAGS_temperature);
  f.tau = absl::GetFlag(FLAGS_tau);
  f.ema_beta = absl::GetFlag(FLAGS_ema_beta);
  f.lambda_intra = absl::GetFlag(FLAGS_lambda_intra);
  f.lambda_inter = absl::GetFlag(FLAGS_lambda_inter);
  f.alpha = absl::GetFlag(FLAGS_alpha);
  f.z_coef = absl::GetFlag(FLAGS_z_coef);
  f.capacity_factor = absl::GetFlag(FLAGS_capacity_factor);
  f.target_expert_cv = absl::GetFlag(FLAGS_target_expert_cv);
  f.balance_rate = absl::GetFlag(FLAGS_balance_rate);
  f.epsilon_ov = absl::GetFlag(FLAGS_epsilon_ov);
  f.epsilon_sys = absl::GetFlag(FLAGS_epsilon_sys);
  f.dual_rate = absl::GetFlag(FLAGS_dual_rate);
  f.num_experts = absl::GetFlag(FLAGS_num_experts);
  f.num_groups = absl::GetFlag(FLAGS_num_groups);
  f.top_k = absl::GetFlag(FLAGS_top_k);
  f.n_layer = absl::GetFlag(FLAGS_n_layer);
  f.n_head = absl::GetFlag(FLAGS_n_head);
  f.d_model = absl::GetFlag(FLAGS_d_model);
  f.d_ff = absl::GetFlag(FLAGS_d_ff);
  f.dense_ff = absl::GetFlag(FLAGS_dense_ff);
  f.block_size = absl::GetFlag(FLAGS_block_size);
  f.moe_every = absl::GetFlag(FLAGS_moe_every);
}

// --steps ... --gemm_gflops.
void ReadTrainingFlags(TrainerFlags& f) {
  f.steps = absl::GetFlag(FLAGS_steps);
  f.batch_size = absl::GetFlag(FLAGS_batch_size);
  f.grad_accum = absl::GetFlag(FLAGS_grad_accum);
  f.split_batch = absl::GetFlag(FLAGS_split_batch);
  f.micro_batches_in_flight = absl::GetFlag(FLAGS_micro_batches_in_flight);
  f.lr = absl::GetFlag(FLAGS_lr);
  f.min_lr = absl::GetFlag(FLAGS_min_lr);
  f.warmup = absl::GetFlag(FLAGS_warmup);
  f.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  f.grad_clip = absl::GetFlag(FLAGS_grad_clip);
  f.eval_every = absl::GetFlag(FLAGS_eval_every);
  f.eval_windows = absl::GetFlag(FLAGS_eval_windows);
  f.seed = absl::GetFlag(FLAGS_seed);
  f.wire_dtype = absl::GetFlag(FLAGS_wire_dtype);
  f.matmul_dtype = absl::GetFlag(FLAGS_matmul_dtype);
  f.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  f.take_over_served_experts = absl::GetFlag(FLAGS_take_over_served_experts);
  f.expert_threads = absl::GetFlag(FLAGS_expert_threads);
  f.split_products = absl::GetFlag(FLAGS_split_products);
  f.profile = absl::GetFlag(FLAGS_profile);
  f.profile_ops = absl::GetFlag(FLAGS_profile_ops);
  f.gemm_gflops = absl::GetFlag(FLAGS_gemm_gflops);
}

// --out_dir ... --log_every, and the flags every service shares.
void ReadRunFlags(TrainerFlags& f) {
  f.out_dir = absl::GetFlag(FLAGS_out_dir);
  f.expert_metrics_port = absl::GetFlag(FLAGS_expert_metrics_port);
  f.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  f.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  f.resume = absl::GetFlag(FLAGS_resume);
  f.on_group_failure = absl::GetFlag(FLAGS_on_group_failure);
  f.max_group_restarts = absl::GetFlag(FLAGS_max_group_restarts);
  f.retry_failed_step = absl::GetFlag(FLAGS_retry_failed_step);
  f.group_run_state = absl::GetFlag(FLAGS_group_run_state);
  f.group_wait_s = absl::GetFlag(FLAGS_group_wait_s);
  f.group_keepalive_ms = absl::GetFlag(FLAGS_group_keepalive_ms);
  f.log_every = absl::GetFlag(FLAGS_log_every);
  f.rank = absl::GetFlag(FLAGS_rank);
  f.world_size = absl::GetFlag(FLAGS_world_size);
  f.master_addr = absl::GetFlag(FLAGS_master_addr);
  f.master_port = absl::GetFlag(FLAGS_master_port);
  f.dist_timeout_s = absl::GetFlag(FLAGS_dist_timeout_s);
  f.ranks = absl::GetFlag(FLAGS_ranks);
  const ServiceFlags service = GetServiceFlags();
  f.threads = service.threads;
  f.blas_probe = service.blas_probe;
  f.metrics_port = service.metrics_port;
  f.tls = service.tls;
}

TrainerFlags FlagsFromCommandLine() {
  TrainerFlags flags;
  ReadModelFlags(flags);
  ReadTrainingFlags(flags);
  ReadRunFlags(flags);
  return flags;
}

// Checks the flags, sets up compute and the metrics endpoint, then trains;
// `stop_signal` gets the stop signal the run stopped on, or 0.
absl::Status Run(int* stop_signal) {
  const TrainerFlags flags = FlagsFromCommandLine();
  HIMOE_RETURN_IF_ERROR(ValidateTrainerFlags(flags));
  HIMOE_ASSIGN_OR_RETURN(const ComputeOptions compute_options, ComputeOptionsFromFlags(flags));
  HIMOE_ASSIGN_OR_RETURN(const ComputeSetup compute, ConfigureCompute(compute_options));
  LogComputeSetup(compute);
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<prometheus::Exposer> exposer,
                         StartServiceMetrics(flags.metrics_port));
  std::shared_ptr<prometheus::Registry> registry;
  if (exposer != nullptr) {
    registry = std::make_shared<prometheus::Registry>();
    exposer->RegisterCollectable(registry);
    std::cerr << "metrics: http://127.0.0.1:" << MetricsPort(*exposer) << "/metrics\n";
  }
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<TrainingRun> run,
                         TrainingRun::Create(flags, compute, registry));
  const absl::Status trained = run->Train();
  *stop_signal = run->stop_signal();
  HIMOE_RETURN_IF_ERROR(trained);
  return run->Report();
}

// --ranks: the compute set-up made once, on the idle machine, before any
// rank or expert process starts: they inherit the BLIS kernels chosen, and
// the ranks the GEMM rate (MFU is the step's, all ranks' tokens, against
// the machine's rate).
absl::StatusOr<int> LaunchRanksAfterComputeSetUp(const TrainerFlags& flags,
                                                 std::vector<std::string> args) {
  HIMOE_RETURN_IF_ERROR(ValidateTrainerFlags(flags));
  HIMOE_ASSIGN_OR_RETURN(const ComputeOptions compute_options, ComputeOptionsFromFlags(flags));
  HIMOE_ASSIGN_OR_RETURN(const ComputeSetup compute, ConfigureCompute(compute_options));
  LogComputeSetup(compute);
  if (flags.gemm_gflops == 0 && compute.gemm_gflops > 0) {
    args.push_back(absl::StrCat("--gemm_gflops=", compute.gemm_gflops));
  }
  return LaunchRanks(flags, args);
}

}  // namespace
}  // namespace himoe::trainer

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  himoe::InitService(argc, argv, himoe::trainer::Info());
  if (const himoe::trainer::TrainerFlags flags = himoe::trainer::FlagsFromCommandLine();
      flags.ranks > 1) {
    const absl::StatusOr<int> code = himoe::trainer::LaunchRanksAfterComputeSetUp(flags, args);
    if (!code.ok()) {
      std::cerr << "himoe-trainer: " << code.status() << "\n";
      return 1;
    }
    return *code;
  }
  int stop_signal = 0;
  const absl::Status status = himoe::trainer::Run(&stop_signal);
  if (stop_signal != 0) {  // stopped as asked, or failing on the way out
    std::cerr << "\nhimoe-trainer: "
              << (absl::IsCancelled(status) ? std::string(status.message()) : status.ToString())
              << "\n";
    return 128 + stop_signal;
  }
  if (!status.ok()) {
    std::cerr << "himoe-trainer: " << status << "\n";
    return 1;
  }
  return 0;
}
