// himoe-trainer: trains a Hi-MoE LM; dense parts and routers here, experts on
// expert-group services (spawned locally, or listed in a cluster file) or in
// this process.
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <glog/logging.h>
#include <prometheus/exposer.h>
#include <prometheus/registry.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/cluster_config.h"
#include "common/compute_setup.h"
#include "common/cpu_cores.h"
#include "common/expert_shape.h"
#include "common/file_util.h"
#include "common/metrics_endpoint.h"
#include "common/process_stats.h"
#include "common/program.h"
#include "common/signals.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "deploy/local/local_cluster.h"
#include "expert_service/expert_client.h"
#include "model/checkpoint_reader.h"
#include "model/model_config.h"
#include "router_service/routing/routing_config.h"
#include "trainer/checkpoint.h"
#include "trainer/run_log.h"
#include "trainer/step_profiler.h"
#include "trainer/trainer.h"
#include "trainer/trainer_metrics.h"

ABSL_FLAG(std::string, experts, "local",
          "where the experts run: local (spawn M himoe-expert processes on 127.0.0.1), "
          "cluster (the services of --cluster), or inprocess");
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
ABSL_FLAG(int, micro_batches_in_flight, 2,
          "with remote experts and --grad_accum > 1: micro-batches run this many at once, one's "
          "dense work beside another's expert calls (the step is the sequential one, bit for "
          "bit; each holds its activations); 1 = one at a time");
ABSL_FLAG(double, lr, 2e-3, "peak learning rate");
ABSL_FLAG(double, min_lr, 2e-4, "final learning rate");
ABSL_FLAG(int64_t, warmup, 30, "warmup steps");
ABSL_FLAG(double, weight_decay, 0.1, "AdamW weight decay (matrices only)");
ABSL_FLAG(double, grad_clip, 1.0, "global grad-norm clip over all shards; 0 = off");
ABSL_FLAG(int64_t, eval_every, 100, "validation every N steps");
ABSL_FLAG(int64_t, eval_windows, 64, "validation windows of block_size tokens");
ABSL_FLAG(uint64_t, seed, 1, "seed of weights and batches");
ABSL_FLAG(int, threads, 0,
          "torch and BLAS threads of this process; 0 = all cores, or with --experts=local, or "
          "--experts=cluster with services on this host, the cores they leave (at least 1)");
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
ABSL_FLAG(int, expert_threads, 1, "torch threads per spawned expert process");
ABSL_FLAG(bool, blas_probe, true,
          "with BLIS and no BLIS_ARCH_TYPE set: time the kernel sets this CPU supports and keep "
          "the fastest (spawned expert processes inherit the choice)");
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
ABSL_FLAG(int, metrics_port, -1, "Prometheus /metrics port; 0 picks one, -1 = off");
ABSL_FLAG(std::string, metrics_address, "0.0.0.0", "interface of the metrics endpoint");
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
          "with --experts=local, reload the last checkpoint, or step 0 without one, and go on); "
          "empty = wait_and_resume with --experts=local, fail otherwise");
ABSL_FLAG(int, max_group_restarts, 3, "group failures wait_and_resume recovers from, then fails");
ABSL_FLAG(std::string, tls_ca, "",
          "mutual TLS to the expert services: PEM of the CA that signs every peer (with "
          "--tls_cert, --tls_key). --experts=local starts its services with them too; "
          "--experts=cluster: all empty = the cluster file's tls, or plaintext");
ABSL_FLAG(std::string, tls_cert, "", "mutual TLS: PEM certificate (chain) of this process");
ABSL_FLAG(std::string, tls_key, "", "mutual TLS: PEM private key of --tls_cert");
ABSL_FLAG(int, group_wait_s, 300,
          "wait_and_resume: seconds to wait for the groups to serve again");
ABSL_FLAG(int64_t, log_every, 10, "progress line every N steps when not on a terminal");

namespace himoe::trainer {
namespace {

absl::StatusOr<router::RoutingConfig> RoutingFromFlags() {
  router::RoutingConfig c;
  c.num_experts = absl::GetFlag(FLAGS_num_experts);
  c.num_groups = absl::GetFlag(FLAGS_num_groups);
  c.top_k = absl::GetFlag(FLAGS_top_k);
  HIMOE_ASSIGN_OR_RETURN(c.method, router::ParseRoutingMethod(absl::GetFlag(FLAGS_method)));
  HIMOE_RETURN_IF_ERROR(router::ApplyPreset(absl::GetFlag(FLAGS_preset), &c));
  c.temperature = absl::GetFlag(FLAGS_temperature);
  c.tau = absl::GetFlag(FLAGS_tau);
  c.ema_beta = absl::GetFlag(FLAGS_ema_beta);
  c.lambda_intra = absl::GetFlag(FLAGS_lambda_intra);
  c.lambda_inter = absl::GetFlag(FLAGS_lambda_inter);
  c.alpha = absl::GetFlag(FLAGS_alpha);
  c.z_coef = absl::GetFlag(FLAGS_z_coef);
  if (absl::GetFlag(FLAGS_capacity_factor) >= 0) {
    c.capacity_factor = absl::GetFlag(FLAGS_capacity_factor);
  }
  const double target = absl::GetFlag(FLAGS_target_expert_cv);
  c.target_expert_cv = target < 0 ? router::DefaultTargetExpertCv(c.method) : target;
  c.balance_rate = absl::GetFlag(FLAGS_balance_rate);
  const double epsilon_ov = absl::GetFlag(FLAGS_epsilon_ov);
  c.epsilon_ov = epsilon_ov < 0 ? router::DefaultEpsilonOv(c.method) : epsilon_ov;
  const double epsilon_sys = absl::GetFlag(FLAGS_epsilon_sys);
  c.epsilon_sys = epsilon_sys < 0 ? router::DefaultEpsilonSys(c.method) : epsilon_sys;
  c.dual_rate = absl::GetFlag(FLAGS_dual_rate);
  HIMOE_RETURN_IF_ERROR(router::ValidateRoutingConfig(c));
  return c;
}

absl::StatusOr<TrainerOptions> OptionsFromFlags() {
  TrainerOptions o;
  model::ModelOptions& m = o.model;
  HIMOE_ASSIGN_OR_RETURN(m.routing, RoutingFromFlags());
  m.n_layer = absl::GetFlag(FLAGS_n_layer);
  m.n_head = absl::GetFlag(FLAGS_n_head);
  m.d_model = absl::GetFlag(FLAGS_d_model);
  m.d_ff = absl::GetFlag(FLAGS_d_ff);
  m.dense_ff = absl::GetFlag(FLAGS_dense_ff);
  m.block_size = absl::GetFlag(FLAGS_block_size);
  m.moe_every = absl::GetFlag(FLAGS_moe_every);
  m.seed = absl::GetFlag(FLAGS_seed);
  {
    absl::StatusOr<v1::DType> matmul = ParseExpertDtype(absl::GetFlag(FLAGS_matmul_dtype));
    if (!matmul.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--matmul_", matmul.status().message()));
    }
    m.matmul_dtype = *matmul;
  }
  const std::string init = absl::GetFlag(FLAGS_init);
  if (init.empty()) {
    m.init = model::InitForPreset(absl::GetFlag(FLAGS_preset));
  } else {
    absl::StatusOr<v1::WeightInit> parsed = ParseWeightInit(init);
    if (!parsed.ok()) return absl::InvalidArgumentError(absl::StrCat("--", parsed.status().message()));
    m.init = *parsed;
  }
  const std::string data = absl::GetFlag(FLAGS_data);
  o.data.paths = data.empty()
                     ? DefaultCorpusPaths()
                     : std::vector<std::string>(absl::StrSplit(data, ',', absl::SkipEmpty()));
  o.data.format = absl::GetFlag(FLAGS_format);
  o.data.val_fraction = absl::GetFlag(FLAGS_val_fraction);
  o.steps = absl::GetFlag(FLAGS_steps);
  o.batch_size = absl::GetFlag(FLAGS_batch_size);
  o.grad_accum = absl::GetFlag(FLAGS_grad_accum);
  // The step profiler follows one thread.
  o.micro_batches_in_flight =
      absl::GetFlag(FLAGS_profile) ? 1 : absl::GetFlag(FLAGS_micro_batches_in_flight);
  o.lr = absl::GetFlag(FLAGS_lr);
  o.min_lr = absl::GetFlag(FLAGS_min_lr);
  o.warmup_steps = absl::GetFlag(FLAGS_warmup);
  o.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  o.grad_clip = absl::GetFlag(FLAGS_grad_clip);
  o.eval_every = absl::GetFlag(FLAGS_eval_every);
  o.eval_windows = absl::GetFlag(FLAGS_eval_windows);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.experts_mode = absl::GetFlag(FLAGS_experts);
  const std::string wire = absl::GetFlag(FLAGS_wire_dtype);
  if (wire != "float32" && wire != "bfloat16") {
    return absl::InvalidArgumentError(
        absl::StrCat("--wire_dtype: expected float32 or bfloat16, got '", wire, "'"));
  }
  o.wire_dtype = wire == "bfloat16" ? c10::kBFloat16 : c10::kFloat;
  return o;
}

TlsFiles TlsFromFlags() {
  return TlsFiles{absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert),
                  absl::GetFlag(FLAGS_tls_key)};
}

// --experts=local: M himoe-expert processes on 127.0.0.1.
absl::StatusOr<std::unique_ptr<local::LocalExpertCluster>> StartLocalExperts(
    const std::string& out_dir, TrainerOptions* o) {
  local::ExpertProcessOptions e;
  e.shape = model::ExpertShapeFor(o->model);
  e.threads = absl::GetFlag(FLAGS_expert_threads);
  e.log_dir = absl::StrCat(out_dir, "/experts");
  e.metrics_port_base = absl::GetFlag(FLAGS_expert_metrics_port);
  e.tls = TlsFromFlags();
  e.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  o->tls = e.tls;
  o->shared_memory = e.shared_memory;
  HIMOE_ASSIGN_OR_RETURN(auto spawned, local::LocalExpertCluster::Start(e));
  o->remote_experts = true;
  o->expert_addresses = spawned->addresses();
  std::cerr << "experts: " << o->model.routing.num_groups << " himoe-expert processes on "
            << absl::StrJoin(o->expert_addresses, ", ") << " (logs in " << spawned->log_dir()
            << ")\n";
  if (!spawned->metrics_addresses().empty()) {
    std::cerr << "expert metrics: http://"
              << absl::StrJoin(spawned->metrics_addresses(), "/metrics, http://") << "/metrics\n";
  }
  return spawned;
}

// --experts=cluster: the routing, expert sizes and addresses of --cluster.
absl::Status UseClusterExperts(TrainerOptions* o) {
  HIMOE_ASSIGN_OR_RETURN(const v1::ClusterConfig cluster,
                         LoadClusterConfig(absl::GetFlag(FLAGS_cluster)));
  model::ModelOptions& m = o->model;
  HIMOE_ASSIGN_OR_RETURN(m.routing, model::RoutingConfigFromCluster(cluster));
  m.d_model = cluster.model().d_model();
  m.d_ff = cluster.model().d_ff();
  m.seed = cluster.model().seed();
  const v1::ExpertShape shape = ExpertShapeFromCluster(cluster);
  m.expert_dtype = shape.dtype();
  // The services' products set the coordinator's too (the handshake would
  // refuse a mismatch).
  if (shape.matmul_dtype() == v1::DTYPE_BFLOAT16) m.matmul_dtype = v1::DTYPE_BFLOAT16;
  m.init = shape.init();
  if (model::NumMoeLayers(m) != cluster.model().num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--cluster: model.num_layers is ", cluster.model().num_layers(), " but this model has ",
        model::NumMoeLayers(m), " MoE layers (--n_layer, --moe_every)"));
  }
  o->remote_experts = true;
  for (const auto& g : cluster.groups()) o->expert_addresses.push_back(g.address());
  o->tls = ClusterTls(cluster, TlsFromFlags());
  return absl::OkStatus();
}

// Where --experts puts the experts; the local processes when it spawned them.
absl::StatusOr<std::unique_ptr<local::LocalExpertCluster>> PlaceExperts(
    const std::string& out_dir, TrainerOptions* o) {
  const std::string& mode = o->experts_mode;
  if (mode == "local") return StartLocalExperts(out_dir, o);
  if (mode == "cluster") {
    HIMOE_RETURN_IF_ERROR(UseClusterExperts(o));
  } else if (mode != "inprocess") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--experts: expected local, cluster or inprocess, got '", mode, "'"));
  }
  return nullptr;
}

// The Prometheus endpoint of --metrics_port (and its RPC hook in `o`).
struct MetricsEndpoint {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<prometheus::Exposer> exposer;
  std::unique_ptr<TrainerMetrics> metrics;  // null without --metrics_port
};

absl::Status StartMetrics(TrainerOptions* o, MetricsEndpoint* endpoint) {
  const int port = absl::GetFlag(FLAGS_metrics_port);
  if (port < 0) return absl::OkStatus();
  HIMOE_ASSIGN_OR_RETURN(
      endpoint->exposer,
      StartMetricsEndpoint("--metrics_port", absl::GetFlag(FLAGS_metrics_address), port));
  endpoint->exposer->RegisterCollectable(endpoint->registry);
  const model::ModelOptions& m = o->model;
  endpoint->metrics = std::make_unique<TrainerMetrics>(
      *endpoint->registry, model::NumMoeLayers(m), m.routing.num_groups, m.routing.num_experts);
  TrainerMetrics* sink = endpoint->metrics.get();
  o->on_rpc = [sink](int group, const std::string& rpc, double seconds) {
    sink->OnRpc(group, rpc, seconds);
  };
  std::cerr << "metrics: http://127.0.0.1:" << MetricsPort(*endpoint->exposer) << "/metrics\n";
  return absl::OkStatus();
}

// Evaluates and logs; returns the validation loss.
absl::StatusOr<double> Evaluate(Trainer& trainer, int64_t step, RunLog& log,
                                TrainerMetrics* metrics) {
  HIMOE_ASSIGN_OR_RETURN(const EvalResult val, trainer.Evaluate());
  log.OnEval(step, val);
  if (metrics != nullptr) metrics->OnEval(val);
  return val.loss;
}

// The stop signal (SIGINT, SIGTERM, SIGHUP) the run stopped on, or 0: the
// trainer then exits 128 + it, as if the signal had killed it.
int g_stop_signal = 0;

std::string SignalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev != nullptr ? absl::StrCat("SIG", abbrev) : absl::StrCat("signal ", sig);
}

// A stop signal between steps: a checkpoint of the steps since the last one
// (when --checkpoint_every is on), a "stop" line in metrics.jsonl, and
// CANCELLED naming the signal and where to resume. The caller then stops the
// expert processes it started, as at the end of a run.
absl::Status StopOnSignal(int sig, Trainer& trainer, RunLog& log, const std::string& checkpoints,
                          int64_t checkpointed_step) {
  g_stop_signal = sig;
  const int64_t step = trainer.step();
  std::string saved;  // empty: no checkpoint to resume from
  if (absl::GetFlag(FLAGS_checkpoint_every) > 0) {
    if (step > checkpointed_step) {
      HIMOE_RETURN_IF_ERROR(
          SaveCheckpoint(trainer, checkpoints, absl::GetFlag(FLAGS_keep_checkpoints)));
      saved = JoinPath(checkpoints, model::CheckpointDirName(step));
    } else if (step > 0) {
      saved = JoinPath(checkpoints, model::CheckpointDirName(step));
    }
  }
  log.OnStop(step, SignalName(sig), saved);
  std::string resume = absl::StrCat("; checkpoint ", saved, " (continue with --resume)");
  if (saved.empty()) {
    resume = absl::GetFlag(FLAGS_checkpoint_every) > 0 ? "; no checkpoint (no step taken)"
                                                        : "; no checkpoint (--checkpoint_every 0)";
  }
  return absl::CancelledError(absl::StrCat("stopped by ", SignalName(sig), " after step ", step,
                                           " of ", trainer.options().steps, resume));
}

// A step, evaluation or checkpoint that failed because a group went away or
// did not answer in time: what --on_group_failure=wait_and_resume recovers.
bool IsGroupFailure(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

// Until every group serves again: with --experts=local, exited processes are
// started again on their addresses (checked on every round: a killed process
// may not have exited yet when its RPCs fail); each group is asked for Info
// until all answer, for up to --group_wait_s.
absl::Status WaitForGroups(const TrainerOptions& o, local::LocalExpertCluster* spawned) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_group_wait_s));
  std::vector<std::unique_ptr<expert::ExpertGroupClient>> clients;
  for (size_t g = 0; g < o.expert_addresses.size(); ++g) {
    expert::ExpertGroupClientOptions co;
    co.group_id = static_cast<int>(g);
    co.addresses = {o.expert_addresses[g]};
    co.deadline = std::chrono::milliseconds(2000);
    co.tls = o.tls;
    HIMOE_ASSIGN_OR_RETURN(auto client, expert::ExpertGroupClient::Create(co));
    clients.push_back(std::move(client));
  }
  while (true) {
    if (spawned != nullptr) {
      HIMOE_ASSIGN_OR_RETURN(const std::vector<int> restarted, spawned->RestartExited());
      if (!restarted.empty()) {
        std::cerr << "restarted expert group(s) " << absl::StrJoin(restarted, ", ") << "\n";
      }
    }
    absl::Status down;
    for (const auto& client : clients) {
      down = client->Info().status();
      if (!down.ok()) break;
    }
    if (down.ok()) break;
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("--on_group_failure=wait_and_resume: the groups did not all serve again "
                       "within ", absl::GetFlag(FLAGS_group_wait_s), " s: ", down.message()));
    }
    if (const int sig = WaitForStopSignal(std::chrono::milliseconds(200)); sig != 0) {
      g_stop_signal = sig;
      return absl::CancelledError(
          absl::StrCat("stopped by ", SignalName(sig), " while waiting for the expert groups"));
    }
  }
  std::cerr << "every expert group serves again\n";
  return absl::OkStatus();
}

// Steps until options.steps, evaluating, checkpointing and reporting progress
// on the way; returns the last validation loss. A stop signal is taken
// between steps (StopOnSignal).
absl::StatusOr<double> TrainLoop(Trainer& trainer, double val, RunLog& log,
                                 TrainerMetrics* metrics, local::LocalExpertCluster* spawned,
                                 const std::string& checkpoints) {
  const TrainerOptions& o = trainer.options();
  const bool tty = isatty(STDERR_FILENO);
  const int64_t every = absl::GetFlag(FLAGS_checkpoint_every);
  constexpr int64_t kProfileWarmup = 3;
  std::unique_ptr<StepProfiler> profiler;
  int64_t profiled_steps = 0;
  int64_t checkpointed_step = trainer.step();  // 0, or the checkpoint resumed from
  // CPU time of this process and its expert processes over the steps after
  // the first kCpuSkipSteps (those the bench times), evaluations and
  // checkpoints left out. A failed /proc read only ends the accounting.
  constexpr int64_t kCpuSkipSteps = 5;
  std::vector<int> pids = {0};
  if (spawned != nullptr) pids.insert(pids.end(), spawned->pids().begin(), spawned->pids().end());
  CpuMeter cpu(pids);
  int64_t cpu_steps = 0;
  bool cpu_ok = true;
  const auto cpu_call = [&cpu_ok](absl::Status status) {
    if (cpu_ok && !status.ok()) LOG(WARNING) << "CPU accounting stopped: " << status;
    cpu_ok = cpu_ok && status.ok();
  };
  while (trainer.step() < o.steps) {
    if (const int sig = PendingStopSignal(); sig != 0) {
      if (tty) std::cerr << "\n";
      return StopOnSignal(sig, trainer, log, checkpoints, checkpointed_step);
    }
    if (cpu_ok && !cpu.running() && trainer.step() >= kCpuSkipSteps) cpu_call(cpu.Start());
    if (spawned != nullptr) HIMOE_RETURN_IF_ERROR(spawned->CheckAlive());
    if (absl::GetFlag(FLAGS_profile) && profiler == nullptr &&
        (trainer.step() >= kProfileWarmup || o.steps <= kProfileWarmup)) {
      HIMOE_ASSIGN_OR_RETURN(profiler, StepProfiler::Start(absl::GetFlag(FLAGS_profile_ops)));
    }
    if (profiler != nullptr) profiler->BeginStep();
    HIMOE_ASSIGN_OR_RETURN(const StepResult r, trainer.Step());
    if (profiler != nullptr) {
      profiler->EndStep();
      ++profiled_steps;
    }
    if (cpu.running()) ++cpu_steps;
    log.OnStep(r);
    if (metrics != nullptr) metrics->OnStep(r);
    const bool eval = r.step % o.eval_every == 0 || r.step == o.steps;
    const bool checkpoint = every > 0 && (r.step % every == 0 || r.step == o.steps);
    if (cpu_ok && cpu.running() && (eval || checkpoint)) cpu_call(cpu.Stop());
    if (eval) {
      HIMOE_ASSIGN_OR_RETURN(val, Evaluate(trainer, r.step, log, metrics));
    }
    if (checkpoint) {
      const auto start = std::chrono::steady_clock::now();
      HIMOE_RETURN_IF_ERROR(
          SaveCheckpoint(trainer, checkpoints, absl::GetFlag(FLAGS_keep_checkpoints)));
      checkpointed_step = r.step;
      LOG(INFO) << "checkpoint: " << JoinPath(checkpoints, model::CheckpointDirName(r.step))
                << " written in "
                << std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::steady_clock::now() - start)
                       .count()
                << " ms";
    }
    if (tty) {
      std::cerr << "\r\033[K" << log.ProgressLine() << std::flush;
      if (eval) std::cerr << "\n";
    } else if (r.step % absl::GetFlag(FLAGS_log_every) == 0 || eval) {
      std::cerr << log.ProgressLine() << "\n";
    }
  }
  if (cpu_ok && cpu.running()) cpu_call(cpu.Stop());
  if (cpu_ok && cpu_steps > 0) {
    const int cores = DefaultThreadCount();
    const std::vector<double>& seconds = cpu.cpu_seconds();
    std::cerr << "\n"
              << log.OnCpu(cpu_steps, cpu.wall_seconds(), cores, seconds[0],
                           std::vector<double>(seconds.begin() + 1, seconds.end()))
              << "\n";
  }
  if (profiler != nullptr) {
    std::string table =
        absl::StrCat("Where a training step's time goes (", profiled_steps, " steps, ",
                     o.experts_mode, " experts):\n\n", profiler->Table(profiled_steps));
    if (absl::GetFlag(FLAGS_profile_ops)) {
      absl::StrAppend(&table, "\nThe most expensive operations (slowed by their timing):\n\n",
                      profiler->TopOperations(profiled_steps, 25));
    }
    std::cerr << "\n" << table;
    HIMOE_RETURN_IF_ERROR(WriteFileAtomically(
        absl::StrCat(absl::GetFlag(FLAGS_out_dir), "/profile.md"), table));
  }
  return val;
}

absl::Status Run() {
  const std::string mode = absl::GetFlag(FLAGS_experts);
  if (absl::GetFlag(FLAGS_expert_metrics_port) < -1 ||
      (absl::GetFlag(FLAGS_expert_metrics_port) != -1 && mode != "local")) {
    return absl::InvalidArgumentError(
        "--expert_metrics_port: a port >= 0, or -1, and only with --experts=local (the cluster "
        "file gives a cluster's metrics ports)");
  }
  ComputeOptions compute_options;
  compute_options.threads = absl::GetFlag(FLAGS_threads);
  if (compute_options.threads == 0 && mode == "local") {
    // The coordinator and its expert processes take turns (each layer waits
    // for the groups), but a coordinator thread per core still spins in
    // OpenMP while the groups compute and takes their core: on 2 cores, 1
    // coordinator thread trains ~15% faster than 2 (README "Throughput").
    compute_options.threads =
        std::max(1, DefaultThreadCount() - absl::GetFlag(FLAGS_num_groups) *
                                               std::max(1, absl::GetFlag(FLAGS_expert_threads)));
  }
  compute_options.gemm_gflops = absl::GetFlag(FLAGS_gemm_gflops);
  // MFU is against the cores the run uses: with local expert processes, all.
  if (mode == "local") compute_options.gemm_threads = DefaultThreadCount();
  if (mode == "cluster") {
    HIMOE_ASSIGN_OR_RETURN(const v1::ClusterConfig cluster,
                           LoadClusterConfig(absl::GetFlag(FLAGS_cluster)));
    // Services of the cluster file on this host keep their threads (as
    // himoe-cluster gives them); the coordinator takes what they leave.
    const int local_threads = LocalServiceThreads(cluster);
    if (compute_options.threads == 0 && local_threads > 0) {
      compute_options.threads = std::max(1, DefaultThreadCount() - local_threads);
    }
    const std::string off = ExpertsOffThisHostCpu(cluster);
    if (off.empty()) {
      const int coordinator =
          compute_options.threads > 0 ? compute_options.threads : DefaultThreadCount();
      compute_options.gemm_threads = std::min(DefaultThreadCount(), coordinator + local_threads);
    } else if (compute_options.gemm_gflops == 0) {
      // This host's CPU rate is not the cluster's limit (an H100's experts
      // gave "MFU 360%").
      compute_options.gemm_gflops = -1;
      LOG(INFO) << "no MFU: " << off
                << "; --gemm_gflops gives the rate of all the cluster's devices";
    }
  }
  compute_options.probe_kernels = absl::GetFlag(FLAGS_blas_probe);
  compute_options.kernel_cache_file = DefaultKernelCacheFile();
  compute_options.split_products = absl::GetFlag(FLAGS_split_products);
  // MFU is against the rate of the products the run makes.
  compute_options.bf16_products = absl::GetFlag(FLAGS_matmul_dtype) == "bfloat16";
  HIMOE_ASSIGN_OR_RETURN(const ComputeSetup compute, ConfigureCompute(compute_options));
  LogComputeSetup(compute);
  HIMOE_ASSIGN_OR_RETURN(TrainerOptions o, OptionsFromFlags());
  o.machine_gflops = compute.gemm_gflops;
  const std::string out_dir = absl::GetFlag(FLAGS_out_dir);
  if (absl::Status s = CreateDirectories(out_dir); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("--out_dir ", out_dir, ": ", s.message()));
  }
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<local::LocalExpertCluster> spawned,
                         PlaceExperts(out_dir, &o));
  // Metrics first, so the RPC latencies of the first step are seen.
  MetricsEndpoint endpoint;
  HIMOE_RETURN_IF_ERROR(StartMetrics(&o, &endpoint));
  const std::string checkpoints = absl::StrCat(out_dir, "/checkpoints");
  std::string on_failure = absl::GetFlag(FLAGS_on_group_failure);
  if (on_failure.empty()) on_failure = mode == "local" ? "wait_and_resume" : "fail";
  if (on_failure != "fail" && on_failure != "wait_and_resume") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--on_group_failure: expected fail or wait_and_resume, got '", on_failure, "'"));
  }
  if (on_failure == "wait_and_resume" && mode == "inprocess") on_failure = "fail";
  TrainerMetrics* metrics = endpoint.metrics.get();
  std::unique_ptr<Trainer> trainer;
  std::unique_ptr<RunLog> log;
  // Creates the trainer (which begins a run on every group), resumes it from
  // the newest checkpoint when asked (or after a group failure, when there is
  // one), and evaluates where it starts.
  const auto start = [&](bool resume) -> absl::StatusOr<double> {
    log.reset();
    trainer.reset();
    HIMOE_ASSIGN_OR_RETURN(trainer, Trainer::Create(o));
    if (trainer->micro_batches_in_flight() > 1) {
      std::cerr << "micro-batches: " << trainer->micro_batches_in_flight() << " of each step's "
                << o.grad_accum << " at once (--micro_batches_in_flight)\n";
    }
    if (resume) {
      HIMOE_ASSIGN_OR_RETURN(const std::string dir, model::LatestCheckpoint(checkpoints));
      HIMOE_RETURN_IF_ERROR(LoadCheckpoint(*trainer, dir));
      std::cerr << "resumed from " << dir << " at step " << trainer->step() << "\n";
    }
    HIMOE_ASSIGN_OR_RETURN(log, RunLog::Create(absl::StrCat(out_dir, "/metrics.jsonl"), o.steps,
                                               50,
                                               resume ? std::optional<int64_t>(trainer->step())
                                                      : std::nullopt));
    log->OnConfig(RunConfigFor(trainer->options(), trainer->step()));
    log->OnCompute(compute, trainer->flops_per_token());
    HIMOE_ASSIGN_OR_RETURN(const double val, Evaluate(*trainer, trainer->step(), *log, metrics));
    std::cerr << absl::StrFormat("step %d: val loss %.4f, val ppl %.3f\n", trainer->step(), val,
                                 std::exp(val));
    return val;
  };
  HIMOE_ASSIGN_OR_RETURN(const double first_val, start(absl::GetFlag(FLAGS_resume)));
  std::cerr << trainer->corpus().Describe() << "\n"
            << "routing: " << router::RoutingConfigDebugString(o.model.routing) << "\n";
  absl::StatusOr<double> trained = TrainLoop(*trainer, first_val, *log, metrics, spawned.get(),
                                             checkpoints);
  for (int failures = 1; !trained.ok() && on_failure == "wait_and_resume" &&
                         IsGroupFailure(trained.status());
       ++failures) {
    std::cerr << "\nexpert group failure at step " << trainer->step() + 1 << " ("
              << failures << " of at most " << absl::GetFlag(FLAGS_max_group_restarts)
              << " recovered): " << trained.status() << "\n";
    if (failures > absl::GetFlag(FLAGS_max_group_restarts)) {
      return absl::Status(trained.status().code(),
                          absl::StrCat("giving up after ", failures - 1,
                                       " recovered group failures: ", trained.status().message()));
    }
    HIMOE_RETURN_IF_ERROR(WaitForGroups(o, spawned.get()));
    const bool has_checkpoint = model::LatestCheckpoint(checkpoints).ok();
    absl::StatusOr<double> resumed = start(has_checkpoint);
    trained = resumed.ok() ? TrainLoop(*trainer, *resumed, *log, metrics, spawned.get(),
                                       checkpoints)
                           : resumed.status();
  }
  HIMOE_ASSIGN_OR_RETURN(const double val, std::move(trained));
  std::cerr << "\n" << log->FinalReport();
  HIMOE_ASSIGN_OR_RETURN(const int64_t coordinator_rss, PeakRssBytes());
  std::vector<int64_t> expert_rss;
  std::string memory = absl::StrFormat("peak RSS: coordinator %.0f MiB", coordinator_rss / 1048576.0);
  if (spawned != nullptr) {
    for (const int pid : spawned->pids()) {
      HIMOE_ASSIGN_OR_RETURN(const int64_t bytes, PeakRssBytes(pid));
      expert_rss.push_back(bytes);
    }
    absl::StrAppend(&memory, ", expert processes ",
                    absl::StrJoin(expert_rss, ", ", [](std::string* out, int64_t bytes) {
                      absl::StrAppendFormat(out, "%.0f", bytes / 1048576.0);
                    }),
                    " MiB");
  }
  log->OnMemory(coordinator_rss, expert_rss);
  std::cerr << memory << "\n";
  std::cerr << absl::StrFormat(
      "validation: loss %.4f -> %.4f, perplexity %.3f -> %.3f (task cross-entropy only)\n"
      "metrics: %s/metrics.jsonl\n",
      first_val, val, std::exp(first_val), std::exp(val), out_dir);
  return absl::OkStatus();
}

}  // namespace
}  // namespace himoe::trainer

int main(int argc, char** argv) {
  himoe::ParseCommandLine(
      argc, argv,
      "Trains a Hi-MoE language model; dense layers and routers here, experts "
      "on expert-group services or in this process.\n"
      "Usage: himoe-trainer [--experts=local|cluster|inprocess] [--cluster=FILE] "
      "[--data=PATHS] [--out_dir=DIR] [flags]");
  google::InitGoogleLogging(argv[0]);
  himoe::PrintStackOnCrash();
  himoe::BlockStopSignals();  // before any thread starts: they inherit the mask
  FLAGS_logtostderr = true;
  const absl::Status status = himoe::trainer::Run();
  if (himoe::trainer::g_stop_signal != 0) {  // stopped as asked, or failing on the way out
    std::cerr << "\nhimoe-trainer: "
              << (absl::IsCancelled(status) ? std::string(status.message()) : status.ToString())
              << "\n";
    return 128 + himoe::trainer::g_stop_signal;
  }
  if (!status.ok()) {
    std::cerr << "himoe-trainer: " << status << "\n";
    return 1;
  }
  return 0;
}
