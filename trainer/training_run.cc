#include "trainer/training_run.h"

#include <glog/logging.h>
#include <ATen/ATen.h>
#include <prometheus/registry.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/cluster_config.h"
#include "common/cpu_cores.h"
#include "common/expert_shape.h"
#include "common/file_util.h"
#include "common/process_stats.h"
#include "common/signals.h"
#include "common/status_macros.h"
#include "deploy/local/local_cluster.h"
#include "expert_service/expert_client.h"
#include "model/checkpoint_reader.h"
#include "trainer/checkpoint.h"
#include "trainer/step_profiler.h"
#include "trainer/trainer_metrics.h"

namespace himoe::trainer {
namespace {

constexpr int64_t kProfileWarmup = 3;
// CPU time is accounted over the steps after the first kCpuSkipSteps (those
// the bench times).
constexpr int64_t kCpuSkipSteps = 5;

std::string SignalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev != nullptr ? absl::StrCat("SIG", abbrev) : absl::StrCat("signal ", sig);
}

// CPU time of this process and its expert processes over the timed steps,
// evaluations and checkpoints left out. A failed /proc read only ends the
// accounting.
class StepCpu {
 public:
  explicit StepCpu(std::vector<int> pids) : meter_(std::move(pids)) {}

  // Before step `step` (0-based).
  void BeforeStep(int64_t step) {
    if (ok_ && !meter_.running() && step >= kCpuSkipSteps) Call(meter_.Start());
  }
  void AfterStep() {
    if (meter_.running()) ++steps_;
  }
  void Pause() {
    if (ok_ && meter_.running()) Call(meter_.Stop());
  }
  // The run log's CPU line, or nothing when no step was timed.
  std::optional<std::string> Finish(RunLog& log) {
    Pause();
    if (!ok_ || steps_ == 0) return std::nullopt;
    const std::vector<double>& seconds = meter_.cpu_seconds();
    return log.OnCpu(steps_, meter_.wall_seconds(), DefaultThreadCount(), seconds[0],
                     std::vector<double>(seconds.begin() + 1, seconds.end()));
  }

 private:
  void Call(const absl::Status& status) {
    if (ok_ && !status.ok()) LOG(WARNING) << "CPU accounting stopped: " << status;
    ok_ = ok_ && status.ok();
  }

  CpuMeter meter_;
  int64_t steps_ = 0;
  bool ok_ = true;
};

}  // namespace

bool IsGroupFailure(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

TrainingRun::TrainingRun(const TrainerFlags& flags, const ComputeSetup& compute)
    : flags_(flags), compute_(compute) {}

TrainingRun::~TrainingRun() = default;

absl::StatusOr<std::unique_ptr<TrainingRun>> TrainingRun::Create(
    const TrainerFlags& flags, const ComputeSetup& compute,
    std::shared_ptr<prometheus::Registry> registry) {
  std::unique_ptr<TrainingRun> run(new TrainingRun(flags, compute));
  HIMOE_ASSIGN_OR_RETURN(run->options_, TrainerOptionsFromFlags(flags));
  run->options_.machine_gflops = compute.gemm_gflops;
  if (absl::Status s = CreateDirectories(flags.out_dir); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("--out_dir ", flags.out_dir, ": ", s.message()));
  }
  run->checkpoints_ = absl::StrCat(flags.out_dir, "/checkpoints");
  run->log_dir_ = flags.out_dir;
  HIMOE_ASSIGN_OR_RETURN(DataParallelOptions ranks, DataParallelOptionsFromFlags(flags));
  if (ranks.world_size > 1) {
    // A group of collectives per micro-batch in flight (unused in process).
    ranks.lanes =
        std::max(1, std::min(run->options_.micro_batches_in_flight, run->options_.grad_accum));
    ranks.on_listening = [](int port) {
      std::cerr << "rendezvous: serving on port " << port << "\n";
    };
    std::cerr << "rank " << ranks.rank << " of " << ranks.world_size << ": joining at "
              << ranks.master_addr << ":" << ranks.master_port << "\n";
    HIMOE_ASSIGN_OR_RETURN(
        run->data_parallel_,
        DataParallel::Create(ranks, RunConfigFor(run->options_, 0).ShortDebugString()));
    run->options_.data_parallel = run->data_parallel_.get();
    if (ranks.rank > 0) {
      run->log_dir_ = JoinPath(flags.out_dir, absl::StrCat("rank", ranks.rank));
      if (absl::Status s = CreateDirectories(run->log_dir_); !s.ok()) {
        return absl::UnavailableError(absl::StrCat(run->log_dir_, ": ", s.message()));
      }
    }
  }
  HIMOE_RETURN_IF_ERROR(run->PlaceExperts());
  if (registry != nullptr) {
    // Before the trainer, so that the RPC latencies of the first step are seen.
    const model::ModelOptions& m = run->options_.model;
    run->registry_ = std::move(registry);
    prometheus::Labels rank;
    if (run->data_parallel_ != nullptr) rank["rank"] = absl::StrCat(run->data_parallel_->rank());
    run->metrics_ = std::make_unique<TrainerMetrics>(
        *run->registry_, model::NumMoeLayers(m), m.routing.num_groups, m.routing.num_experts, rank);
    TrainerMetrics* sink = run->metrics_.get();
    run->options_.on_rpc = [sink](int group, const std::string& rpc, double seconds) {
      sink->OnRpc(group, rpc, seconds);
    };
  }
  return run;
}

absl::Status TrainingRun::PlaceExperts() {
  if (flags_.experts == "local") return StartLocalExperts();
  if (flags_.experts == "cluster") return UseClusterExperts();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<local::LocalExpertCluster>> StartLocalExpertProcesses(
    const TrainerFlags& flags, const model::ModelOptions& model) {
  local::ExpertProcessOptions e;
  e.shape = model::ExpertShapeFor(model);
  e.threads = flags.expert_threads;
  e.log_dir = absl::StrCat(flags.out_dir, "/experts");
  e.metrics_port_base = flags.expert_metrics_port;
  e.tls = flags.tls;
  e.shared_memory = flags.shared_memory;
  e.run_state = flags.group_run_state;
  return local::LocalExpertCluster::Start(e);
}

// --experts=local: M himoe-expert processes on 127.0.0.1, started here or,
// with --expert_addresses, by the launcher of the ranks.
absl::Status TrainingRun::StartLocalExperts() {
  TrainerOptions& o = options_;
  o.tls = flags_.tls;
  o.shared_memory = flags_.shared_memory;
  o.remote_experts = true;
  if (!flags_.expert_addresses.empty()) {
    o.expert_addresses = absl::StrSplit(flags_.expert_addresses, ',', absl::SkipEmpty());
    return absl::OkStatus();
  }
  HIMOE_ASSIGN_OR_RETURN(spawned_, StartLocalExpertProcesses(flags_, o.model));
  o.expert_addresses = spawned_->addresses();
  std::cerr << "experts: " << o.model.routing.num_groups << " himoe-expert processes on "
            << absl::StrJoin(o.expert_addresses, ", ") << " (logs in " << spawned_->log_dir()
            << ")\n";
  if (!spawned_->metrics_addresses().empty()) {
    std::cerr << "expert metrics: http://"
              << absl::StrJoin(spawned_->metrics_addresses(), "/metrics, http://") << "/metrics\n";
  }
  return absl::OkStatus();
}

// --experts=cluster: the routing, expert sizes and addresses of --cluster.
absl::Status TrainingRun::UseClusterExperts() {
  HIMOE_ASSIGN_OR_RETURN(const v1::ClusterConfig cluster, LoadClusterConfig(flags_.cluster));
  model::ModelOptions& m = options_.model;
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
  options_.remote_experts = true;
  for (const auto& g : cluster.groups()) options_.expert_addresses.push_back(g.address());
  options_.tls = ClusterTls(cluster, flags_.tls, ClusterRole::kTrainer);
  return absl::OkStatus();
}

absl::StatusOr<double> TrainingRun::Evaluate(int64_t step) {
  if (!lead()) return std::nan("");  // rank 0's
  HIMOE_ASSIGN_OR_RETURN(const EvalResult val, trainer_->Evaluate());
  log_->OnEval(step, val);
  if (metrics_ != nullptr) metrics_->OnEval(val);
  return val.loss;
}

absl::StatusOr<double> TrainingRun::Start(bool resume) {
  log_.reset();
  trainer_.reset();
  HIMOE_ASSIGN_OR_RETURN(trainer_, Trainer::Create(options_));
  if (trainer_->micro_batches_in_flight() > 1) {
    std::cerr << "micro-batches: " << trainer_->micro_batches_in_flight() << " of each step's "
              << options_.grad_accum << " at once (--micro_batches_in_flight)\n";
  }
  if (resume) {
    HIMOE_ASSIGN_OR_RETURN(const std::string dir, model::LatestCheckpoint(checkpoints_));
    HIMOE_RETURN_IF_ERROR(LoadCheckpoint(*trainer_, dir));
    // No rank calls the groups before rank 0 has restored them.
    if (data_parallel_ != nullptr) HIMOE_RETURN_IF_ERROR(data_parallel_->Barrier());
    std::cerr << "resumed from " << dir << " at step " << trainer_->step() << "\n";
  }
  checkpointed_step_ = trainer_->step();  // 0, or the checkpoint resumed from
  const std::optional<int64_t> resumed_at =
      resume ? std::optional<int64_t>(trainer_->step()) : std::nullopt;
  HIMOE_ASSIGN_OR_RETURN(log_, RunLog::Create(absl::StrCat(log_dir_, "/metrics.jsonl"),
                                              options_.steps, 50, resumed_at));
  log_->OnConfig(RunConfigFor(trainer_->options(), trainer_->step()));
  log_->OnCompute(compute_, trainer_->flops_per_token());
  HIMOE_ASSIGN_OR_RETURN(const double val, Evaluate(trainer_->step()));
  if (lead()) {
    std::cerr << absl::StrFormat("step %d: val loss %.4f, val ppl %.3f\n", trainer_->step(), val,
                                 std::exp(val));
  }
  return val;
}

absl::Status TrainingRun::Train() {
  HIMOE_ASSIGN_OR_RETURN(first_val_, Start(flags_.resume));
  std::cerr << trainer_->corpus().Describe() << "\n"
            << "routing: " << router::RoutingConfigDebugString(options_.model.routing) << "\n";
  absl::StatusOr<double> trained = TrainLoop(first_val_);
  // Across ranks a failed group ends the run (wait_and_resume is refused).
  const bool recover = WaitAndResume(flags_) && data_parallel_ == nullptr;
  for (int failures = 1; !trained.ok() && recover && IsGroupFailure(trained.status()); ++failures) {
    std::cerr << "\nexpert group failure at step " << trainer_->step() + 1 << " (" << failures
              << " of at most " << flags_.max_group_restarts << " recovered): " << trained.status()
              << "\n";
    if (failures > flags_.max_group_restarts) {
      return absl::Status(trained.status().code(),
                          absl::StrCat("giving up after ", failures - 1,
                                       " recovered group failures: ", trained.status().message()));
    }
    HIMOE_RETURN_IF_ERROR(WaitForGroups());
    if (flags_.retry_failed_step && trainer_->failed_step_retryable()) {
      // The trainer's own channels may still be reconnecting (backoff up to 1 s).
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      absl::Status kept = trainer_->RetryFailedStep();
      while (IsGroupFailure(kept) && trainer_->failed_step_retryable() &&
             std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        kept = trainer_->RetryFailedStep();
      }
      if (kept.ok()) {
        std::cerr << "every expert group kept its state: step " << trainer_->step() + 1
                  << " runs again (no checkpoint reloaded)\n";
        trained = TrainLoop(val_);
        continue;
      }
      std::cerr << "step " << trainer_->step() + 1 << " cannot run again in place (" << kept
                << "); reloading the last checkpoint\n";
    }
    const bool has_checkpoint = model::LatestCheckpoint(checkpoints_).ok();
    absl::StatusOr<double> resumed = Start(has_checkpoint);
    trained = resumed.ok() ? TrainLoop(*resumed) : resumed.status();
  }
  HIMOE_ASSIGN_OR_RETURN(last_val_, std::move(trained));
  return absl::OkStatus();
}

absl::StatusOr<double> TrainingRun::TrainLoop(double val) {
  val_ = val;
  const TrainerOptions& o = trainer_->options();
  const bool tty = isatty(STDERR_FILENO);
  std::unique_ptr<StepProfiler> profiler;
  int64_t profiled_steps = 0;
  std::vector<int> pids = {0};
  if (spawned_ != nullptr)
    pids.insert(pids.end(), spawned_->pids().begin(), spawned_->pids().end());
  StepCpu cpu(pids);
  while (trainer_->step() < o.steps) {
    HIMOE_ASSIGN_OR_RETURN(const int sig, AgreedStopSignal());
    if (sig != 0) {
      if (tty) std::cerr << "\n";
      return StopOnSignal(sig);
    }
    cpu.BeforeStep(trainer_->step());
    if (spawned_ != nullptr) HIMOE_RETURN_IF_ERROR(spawned_->CheckAlive());
    if (flags_.profile && profiler == nullptr &&
        (trainer_->step() >= kProfileWarmup || o.steps <= kProfileWarmup)) {
      HIMOE_ASSIGN_OR_RETURN(profiler, StepProfiler::Start(flags_.profile_ops));
    }
    if (profiler != nullptr) profiler->BeginStep();
    HIMOE_ASSIGN_OR_RETURN(const StepResult r, trainer_->Step());
    if (profiler != nullptr) {
      profiler->EndStep();
      ++profiled_steps;
    }
    cpu.AfterStep();
    log_->OnStep(r);
    if (metrics_ != nullptr) metrics_->OnStep(r);
    const bool eval = r.step % o.eval_every == 0 || r.step == o.steps;
    const int64_t every = flags_.checkpoint_every;
    const bool checkpoint = every > 0 && (r.step % every == 0 || r.step == o.steps);
    if (eval || checkpoint) cpu.Pause();
    HIMOE_ASSIGN_OR_RETURN(val, AfterStep(r, eval, checkpoint, val));
    val_ = val;
  }
  if (const std::optional<std::string> line = cpu.Finish(*log_); line.has_value()) {
    std::cerr << "\n" << *line << "\n";
  }
  if (profiler != nullptr) {
    std::string table =
        absl::StrCat("Where a training step's time goes (", profiled_steps, " steps, ",
                     o.experts_mode, " experts):\n\n", profiler->Table(profiled_steps));
    if (flags_.profile_ops) {
      absl::StrAppend(&table, "\nThe most expensive operations (slowed by their timing):\n\n",
                      profiler->TopOperations(profiled_steps, 25));
    }
    std::cerr << "\n" << table;
    HIMOE_RETURN_IF_ERROR(WriteFileAtomically(absl::StrCat(flags_.out_dir, "/profile.md"), table));
  }
  return val;
}

absl::StatusOr<double> TrainingRun::AfterStep(const StepResult& r, bool eval, bool checkpoint,
                                              double val) {
  if (eval) {
    HIMOE_ASSIGN_OR_RETURN(val, Evaluate(r.step));
  }
  if (!lead()) return val;
  if (checkpoint) HIMOE_RETURN_IF_ERROR(SaveCheckpointNow());
  if (isatty(STDERR_FILENO)) {
    std::cerr << "\r\033[K" << log_->ProgressLine() << std::flush;
    if (eval) std::cerr << "\n";
  } else if (r.step % flags_.log_every == 0 || eval) {
    std::cerr << log_->ProgressLine() << "\n";
  }
  return val;
}

absl::Status TrainingRun::SaveCheckpointNow() {
  const auto start = std::chrono::steady_clock::now();
  HIMOE_RETURN_IF_ERROR(SaveCheckpoint(*trainer_, checkpoints_, flags_.keep_checkpoints));
  checkpointed_step_ = trainer_->step();
  LOG(INFO) << "checkpoint: "
            << JoinPath(checkpoints_, model::CheckpointDirName(checkpointed_step_))
            << " written in "
            << std::chrono::duration_cast<std::chrono::milliseconds>(
                   std::chrono::steady_clock::now() - start)
                   .count()
            << " ms";
  return absl::OkStatus();
}

absl::Status TrainingRun::StopOnSignal(int sig) {
  stop_signal_ = sig;
  const int64_t step = trainer_->step();
  std::string saved;  // empty: no checkpoint to resume from
  if (flags_.checkpoint_every > 0) {
    if (step > checkpointed_step_ && lead()) {
      HIMOE_RETURN_IF_ERROR(SaveCheckpoint(*trainer_, checkpoints_, flags_.keep_checkpoints));
      saved = JoinPath(checkpoints_, model::CheckpointDirName(step));
    } else if (step > 0) {
      saved = JoinPath(checkpoints_, model::CheckpointDirName(step));
    }
  }
  log_->OnStop(step, SignalName(sig), saved);
  std::string resume = absl::StrCat("; checkpoint ", saved, " (continue with --resume)");
  if (saved.empty()) {
    resume = flags_.checkpoint_every > 0 ? "; no checkpoint (no step taken)"
                                         : "; no checkpoint (--checkpoint_every 0)";
  }
  return absl::CancelledError(absl::StrCat("stopped by ", SignalName(sig), " after step ", step,
                                           " of ", options_.steps, resume));
}

absl::StatusOr<int> TrainingRun::AgreedStopSignal() {
  const int sig = PendingStopSignal();
  if (data_parallel_ == nullptr) return sig;
  at::Tensor signals = at::zeros({data_parallel_->world_size()}, at::kDouble);
  signals[data_parallel_->rank()] = sig;
  HIMOE_RETURN_IF_ERROR(data_parallel_->AllReduceSum({signals}));
  for (int r = 0; r < data_parallel_->world_size(); ++r) {
    if (const int s = static_cast<int>(signals[r].item<double>()); s != 0) return s;
  }
  return 0;
}

absl::Status TrainingRun::WaitForGroups() {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(flags_.group_wait_s);
  std::vector<std::unique_ptr<expert::ExpertGroupClient>> clients;
  for (size_t g = 0; g < options_.expert_addresses.size(); ++g) {
    expert::ExpertGroupClientOptions co;
    co.group_id = static_cast<int>(g);
    co.addresses = {options_.expert_addresses[g]};
    co.deadline = std::chrono::milliseconds(2000);
    co.tls = options_.tls;
    HIMOE_ASSIGN_OR_RETURN(auto client, expert::ExpertGroupClient::Create(co));
    clients.push_back(std::move(client));
  }
  while (true) {
    // Checked every round: a killed process may not have exited yet when its
    // RPCs fail.
    if (spawned_ != nullptr) {
      HIMOE_ASSIGN_OR_RETURN(const std::vector<int> restarted, spawned_->RestartExited());
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
      const absl::StatusOr<std::string> last = model::LatestCheckpoint(checkpoints_);
      return absl::DeadlineExceededError(absl::StrCat(
          "--on_group_failure=wait_and_resume: the groups did not all serve again within ",
          flags_.group_wait_s, " s: ", down.message(), "; the last good checkpoint is ",
          last.ok() ? absl::StrCat(*last, " (continue with --resume)") : "none"));
    }
    if (const int sig = WaitForStopSignal(std::chrono::milliseconds(200)); sig != 0) {
      stop_signal_ = sig;
      return absl::CancelledError(
          absl::StrCat("stopped by ", SignalName(sig), " while waiting for the expert groups"));
    }
  }
  std::cerr << "every expert group serves again\n";
  return absl::OkStatus();
}

absl::Status TrainingRun::Report() {
  if (!lead()) {
    std::cerr << "rank " << data_parallel_->rank() << ": trained to step " << trainer_->step()
              << "; run log " << log_dir_ << "/metrics.jsonl\n";
    return absl::OkStatus();
  }
  std::cerr << "\n" << log_->FinalReport();
  HIMOE_ASSIGN_OR_RETURN(const int64_t coordinator_rss, PeakRssBytes());
  std::vector<int64_t> expert_rss;
  std::string memory =
      absl::StrFormat("peak RSS: coordinator %.0f MiB", coordinator_rss / 1048576.0);
  if (spawned_ != nullptr) {
    for (const int pid : spawned_->pids()) {
      HIMOE_ASSIGN_OR_RETURN(const int64_t bytes, PeakRssBytes(pid));
      expert_rss.push_back(bytes);
    }
    absl::StrAppend(&memory, ", expert processes ",
                    absl::StrJoin(expert_rss, ", ",
                                  [](std::string* out, int64_t bytes) {
                                    absl::StrAppendFormat(out, "%.0f", bytes / 1048576.0);
                                  }),
                    " MiB");
  }
  log_->OnMemory(coordinator_rss, expert_rss);
  std::cerr << memory << "\n";
  std::cerr << absl::StrFormat(
      "validation: loss %.4f -> %.4f, perplexity %.3f -> %.3f (task cross-entropy only)\n"
      "metrics: %s/metrics.jsonl\n",
      first_val_, last_val_, std::exp(first_val_), std::exp(last_val_), flags_.out_dir);
  return absl::OkStatus();
}

}  // namespace himoe::trainer
