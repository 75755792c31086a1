#include "trainer/trainer_flags.h"

#include <glog/logging.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/cluster_config.h"
#include "common/cpu_cores.h"
#include "common/expert_shape.h"
#include "common/status_macros.h"
#include "trainer/data.h"

namespace himoe::trainer {
namespace {

absl::Status Refuse(absl::string_view flag, absl::string_view expected, absl::string_view got) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, ": expected ", expected, ", got '", got, "'"));
}

// The parsers' messages begin with "dtype: " and "init: ".
absl::StatusOr<v1::DType> ParseMatmulDtype(const std::string& name) {
  absl::StatusOr<v1::DType> dtype = ParseExpertDtype(name);
  if (!dtype.ok())
    return absl::InvalidArgumentError(absl::StrCat("--matmul_", dtype.status().message()));
  return dtype;
}

absl::StatusOr<v1::WeightInit> InitFromFlags(const TrainerFlags& f) {
  if (f.init.empty()) return model::InitForPreset(f.preset);
  absl::StatusOr<v1::WeightInit> init = ParseWeightInit(f.init);
  if (!init.ok()) return absl::InvalidArgumentError(absl::StrCat("--", init.status().message()));
  return init;
}

absl::Status ValidateModes(const TrainerFlags& f) {
  if (f.experts != "local" && f.experts != "cluster" && f.experts != "inprocess") {
    return Refuse("experts", "local, cluster or inprocess", f.experts);
  }
  if (f.experts == "cluster" && f.cluster.empty()) {
    return absl::InvalidArgumentError("--cluster: a cluster file is needed with --experts=cluster");
  }
  if (f.expert_metrics_port < -1 || (f.expert_metrics_port != -1 && f.experts != "local")) {
    return absl::InvalidArgumentError(
        "--expert_metrics_port: a port >= 0, or -1, and only with --experts=local (the cluster "
        "file gives a cluster's metrics ports)");
  }
  if (f.group_run_state && f.experts != "local") {
    return absl::InvalidArgumentError(
        "--group_run_state: only with --experts=local (give each himoe-expert of a cluster "
        "--run_state_file)");
  }
  if (!f.expert_addresses.empty() && f.experts != "local") {
    return absl::InvalidArgumentError(
        "--expert_addresses: only with --experts=local (a cluster file lists a cluster's groups)");
  }
  if (!f.expert_addresses.empty() &&
      static_cast<int>(
          std::vector<std::string>(absl::StrSplit(f.expert_addresses, ',', absl::SkipEmpty()))
              .size()) != f.num_groups) {
    return absl::InvalidArgumentError(absl::StrCat("--expert_addresses: '", f.expert_addresses,
                                                   "'; expected ", f.num_groups,
                                                   " addresses, one per group (--num_groups)"));
  }
  if (f.ranks < 1) return Refuse("ranks", "a rank count >= 1", absl::StrCat(f.ranks));
  if (f.ranks > 1 && (f.rank >= 0 || f.world_size > 0)) {
    return absl::InvalidArgumentError(
        "--ranks: starts every rank itself; --rank and --world_size are for one rank started "
        "by hand or by another launcher");
  }
  if (f.split_batch < 0 || (f.split_batch > 0 && f.batch_size % f.split_batch != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--split_batch: ", f.split_batch, "; expected 0 (automatic) or a divisor of "
                     "--batch_size=", f.batch_size));
  }
  if (!f.on_group_failure.empty() && f.on_group_failure != "fail" &&
      f.on_group_failure != "wait_and_resume") {
    return Refuse("on_group_failure", "fail or wait_and_resume", f.on_group_failure);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateTrainerFlags(const TrainerFlags& f) {
  HIMOE_RETURN_IF_ERROR(ValidateModes(f));
  if (f.wire_dtype != "float32" && f.wire_dtype != "bfloat16") {
    return Refuse("wire_dtype", "float32 or bfloat16", f.wire_dtype);
  }
  HIMOE_RETURN_IF_ERROR(ParseMatmulDtype(f.matmul_dtype).status());
  HIMOE_RETURN_IF_ERROR(InitFromFlags(f).status());
  if (f.eval_every < 1)
    return Refuse("eval_every", "a step count >= 1", absl::StrCat(f.eval_every));
  if (f.log_every < 1) return Refuse("log_every", "a step count >= 1", absl::StrCat(f.log_every));
  if (f.checkpoint_every < 0) {
    return Refuse("checkpoint_every", "a step count >= 0", absl::StrCat(f.checkpoint_every));
  }
  if (f.keep_checkpoints < 1) {
    return Refuse("keep_checkpoints", "a count >= 1", absl::StrCat(f.keep_checkpoints));
  }
  if (f.max_group_restarts < 0) {
    return Refuse("max_group_restarts", "a count >= 0", absl::StrCat(f.max_group_restarts));
  }
  if (f.group_keepalive_ms < 0) {
    return Refuse("group_keepalive_ms", "milliseconds >= 0 (0 = off)",
                  absl::StrCat(f.group_keepalive_ms));
  }
  if (f.group_wait_s < 0) {
    return Refuse("group_wait_s", "seconds >= 0", absl::StrCat(f.group_wait_s));
  }
  return absl::OkStatus();
}

bool WaitAndResume(const TrainerFlags& f) {
  if (f.experts == "inprocess") return false;
  if (f.on_group_failure.empty()) return f.experts == "local";
  return f.on_group_failure == "wait_and_resume";
}

absl::StatusOr<router::RoutingConfig> RoutingConfigFromFlags(const TrainerFlags& f) {
  router::RoutingConfig c;
  c.num_experts = f.num_experts;
  c.num_groups = f.num_groups;
  c.top_k = f.top_k;
  HIMOE_ASSIGN_OR_RETURN(c.method, router::ParseRoutingMethod(f.method));
  HIMOE_RETURN_IF_ERROR(router::ApplyPreset(f.preset, &c));
  c.temperature = f.temperature;
  c.tau = f.tau;
  c.ema_beta = f.ema_beta;
  c.lambda_intra = f.lambda_intra;
  c.lambda_inter = f.lambda_inter;
  c.alpha = f.alpha;
  c.z_coef = f.z_coef;
  if (f.capacity_factor >= 0) c.capacity_factor = f.capacity_factor;
  c.target_expert_cv =
      f.target_expert_cv < 0 ? router::DefaultTargetExpertCv(c.method) : f.target_expert_cv;
  c.balance_rate = f.balance_rate;
  c.epsilon_ov = f.epsilon_ov < 0 ? router::DefaultEpsilonOv(c.method) : f.epsilon_ov;
  c.epsilon_sys = f.epsilon_sys < 0 ? router::DefaultEpsilonSys(c.method) : f.epsilon_sys;
  c.dual_rate = f.dual_rate;
  HIMOE_RETURN_IF_ERROR(router::ValidateRoutingConfig(c));
  return c;
}

absl::StatusOr<TrainerOptions> TrainerOptionsFromFlags(const TrainerFlags& f) {
  HIMOE_RETURN_IF_ERROR(ValidateTrainerFlags(f));
  TrainerOptions o;
  model::ModelOptions& m = o.model;
  HIMOE_ASSIGN_OR_RETURN(m.routing, RoutingConfigFromFlags(f));
  m.n_layer = f.n_layer;
  m.n_head = f.n_head;
  m.d_model = f.d_model;
  m.d_ff = f.d_ff;
  m.dense_ff = f.dense_ff;
  m.block_size = f.block_size;
  m.moe_every = f.moe_every;
  m.seed = f.seed;
  HIMOE_ASSIGN_OR_RETURN(m.matmul_dtype, ParseMatmulDtype(f.matmul_dtype));
  HIMOE_ASSIGN_OR_RETURN(m.init, InitFromFlags(f));
  o.data.paths = f.data.empty()
                     ? DefaultCorpusPaths()
                     : std::vector<std::string>(absl::StrSplit(f.data, ',', absl::SkipEmpty()));
  o.data.format = f.format;
  o.data.val_fraction = f.val_fraction;
  o.steps = f.steps;
  // Remote experts: two halves of each batch in flight, one's dense work
  // while the other's rows are on the wire (docs/benchmarks.md, Link).
  const int split = f.split_batch > 0 ? f.split_batch
                    : f.experts != "inprocess" && f.batch_size % 2 == 0 && !f.profile ? 2
                                                                                       : 1;
  o.batch_size = f.batch_size / split;
  o.grad_accum = f.grad_accum * split;
  // The step profiler follows one thread.
  o.micro_batches_in_flight = f.profile ? 1 : f.micro_batches_in_flight;
  o.lr = f.lr;
  o.min_lr = f.min_lr;
  o.warmup_steps = f.warmup;
  o.weight_decay = f.weight_decay;
  o.grad_clip = f.grad_clip;
  o.eval_every = f.eval_every;
  o.eval_windows = f.eval_windows;
  o.seed = f.seed;
  o.experts_mode = f.experts;
  o.wire_dtype = f.wire_dtype == "bfloat16" ? c10::kBFloat16 : c10::kFloat;
  o.take_over_served_experts = f.take_over_served_experts;
  o.group_keepalive = std::chrono::milliseconds(f.group_keepalive_ms);
  return o;
}

absl::StatusOr<DataParallelOptions> DataParallelOptionsFromFlags(const TrainerFlags& f) {
  HIMOE_ASSIGN_OR_RETURN(DataParallelOptions o,
                         DataParallelOptionsFromEnvironment(DataParallelOptions()));
  if (f.world_size < 0)
    return Refuse("world_size", "a rank count >= 1, or 0", absl::StrCat(f.world_size));
  if (f.world_size > 0) o.world_size = f.world_size;
  if (f.rank >= 0) o.rank = f.rank;
  if (o.rank >= o.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("--rank: ", o.rank,
                                                   " is not below the world size ", o.world_size,
                                                   " (--world_size or WORLD_SIZE)"));
  }
  if (!f.master_addr.empty()) o.master_addr = f.master_addr;
  if (f.master_port > 65535) {
    return Refuse("master_port", "a port in 1..65535, or -1", absl::StrCat(f.master_port));
  }
  if (f.master_port >= 0) o.master_port = f.master_port;
  if (f.dist_timeout_s < 1) {
    return Refuse("dist_timeout_s", "seconds >= 1", absl::StrCat(f.dist_timeout_s));
  }
  o.timeout = std::chrono::seconds(f.dist_timeout_s);
  if (o.world_size > 1 && f.experts == "local" && f.expert_addresses.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--experts=local: each of the ", o.world_size,
        " ranks would start its own expert processes; start them once (--ranks starts the "
        "ranks and their groups; or pass --expert_addresses), share a cluster file's "
        "(--experts=cluster) or hold every expert (--experts=inprocess)"));
  }
  if (o.world_size > 1 && f.on_group_failure == "wait_and_resume") {
    return absl::InvalidArgumentError(
        "--on_group_failure=wait_and_resume: with more than one rank a failed group ends the run "
        "(--on_group_failure=fail); rerun every rank with --resume");
  }
  return o;
}

absl::StatusOr<ComputeOptions> ComputeOptionsFromFlags(const TrainerFlags& f) {
  ComputeOptions c;
  c.threads = f.threads;
  if (c.threads == 0 && f.experts == "local") {
    // The coordinator and its expert processes take turns (each layer waits
    // for the groups), but a coordinator thread per core still spins in
    // OpenMP while the groups compute and takes their core.
    c.threads = std::max(1, DefaultThreadCount() - f.num_groups * std::max(1, f.expert_threads));
  }
  c.gemm_gflops = f.gemm_gflops;
  // MFU is against the cores the run uses: with local expert processes, all.
  if (f.experts == "local") c.gemm_threads = DefaultThreadCount();
  if (f.experts == "cluster") {
    HIMOE_ASSIGN_OR_RETURN(const v1::ClusterConfig cluster, LoadClusterConfig(f.cluster));
    // Services of the cluster file on this host keep their threads (as
    // himoe-cluster gives them); the coordinator takes what they leave.
    const int local_threads = LocalServiceThreads(cluster);
    if (c.threads == 0 && local_threads > 0) {
      c.threads = std::max(1, DefaultThreadCount() - local_threads);
    }
    const std::string off = ExpertsOffThisHostCpu(cluster);
    if (off.empty()) {
      const int coordinator = c.threads > 0 ? c.threads : DefaultThreadCount();
      c.gemm_threads = std::min(DefaultThreadCount(), coordinator + local_threads);
    } else if (c.gemm_gflops == 0) {
      // This host's CPU rate is not the cluster's limit.
      c.gemm_gflops = -1;
      LOG(INFO) << "no MFU: " << off
                << "; --gemm_gflops gives the rate of all the cluster's devices";
    }
  }
  c.probe_kernels = f.blas_probe;
  c.kernel_cache_file = DefaultKernelCacheFile();
  c.split_products = f.split_products;
  // MFU is against the rate of the products the run makes.
  c.bf16_products = f.matmul_dtype == "bfloat16";
  return c;
}

}  // namespace himoe::trainer
