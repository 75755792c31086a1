#ifndef HIMOE_TRAINER_TRAINER_H_
#define HIMOE_TRAINER_TRAINER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "himoe/v1/model.pb.h"
#include "model/model_config.h"
#include "model/transformer_lm.h"
#include "router_service/routing/router_layer.h"
#include "trainer/backend_moe.h"
#include "trainer/data.h"
#include "trainer/data_parallel.h"
#include "trainer/expert_backend.h"
#include "trainer/micro_batch_turns.h"

namespace torch::optim {
class AdamW;
}

namespace himoe {
class ComputePool;
}

namespace himoe::trainer {

struct TrainerOptions {
  model::ModelOptions model;
  DataOptions data;
  // Experts: in this process (LocalMoE-style) or on himoe-expert services
  // (one address per group).
  bool remote_experts = false;
  std::vector<std::string> expert_addresses;
  // Mutual TLS to the expert services (empty = plaintext).
  TlsFiles tls;
  // Remote experts: ExpertBackendOptions::keepalive.
  std::chrono::milliseconds group_keepalive{0};
  // Where the experts run, as recorded in the checkpoints and the run log:
  // local, cluster or inprocess; empty = "remote" or "inprocess".
  std::string experts_mode;
  // Remote experts: the training run begun on every group (see
  // ExpertBackendOptions::run_id); empty = a new unique id.
  std::string run_id;
  // Remote experts: begin the run on groups serving a router's model too
  // (ExpertBackendOptions::take_over_served).
  bool take_over_served_experts = false;
  // The experts' rows, outputs and gradients on the wire (kFloat or
  // kBFloat16; see ExpertBackendOptions::wire_dtype).
  c10::ScalarType wire_dtype = c10::kFloat;
  // Remote experts on this host: tensors through shared memory (see
  // ExpertBackendOptions::shared_memory).
  bool shared_memory = false;
  // Remote experts with grad_accum > 1: this many micro-batches run at once
  // (a thread each), so that one's dense work overlaps another's expert
  // calls. Routing, the groups' gradient sums and the dense gradient sum go
  // in micro-batch order, so the step is the sequential one bit for bit; each
  // micro-batch in flight holds its activations. 1 = one at a time.
  int micro_batches_in_flight = 2;
  // One rank of several (not owned; null = the only one): its batches are
  // its share of the sequence one rank would draw for grad_accum x
  // world_size micro-batches (micro-batch a*world_size + rank of the step),
  // the gradients and the step's losses are summed over the ranks, and the
  // routers move as in that one rank (BackendMoE::RouteTraining). Needs
  // lanes >= micro_batches_in_flight.
  DataParallel* data_parallel = nullptr;
  // Remote experts: (group, RPC, seconds) of every call, from gRPC threads.
  std::function<void(int, const std::string&, double)> on_rpc;

  int64_t steps = 200;
  int64_t batch_size = 16;
  int grad_accum = 1;
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup_steps = 20;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double grad_clip = 1.0;  // 0 = off
  int64_t eval_every = 50;
  int64_t eval_windows = 64;
  uint64_t seed = 1;
  // The machine's GEMM rate (ComputeSetup::gemm_gflops) that MFU is measured
  // against; 0 = unknown.
  double machine_gflops = 0;
};

// A training run's id, unique across hosts and restarts: host, pid, 64 random
// bits.
std::string NewRunId();

// Warmup then cosine decay to min_lr at the last step (nanoGPT's schedule).
double CosineLearningRate(const TrainerOptions& options, int64_t step);

// Every model, routing and training setting of a run at `step`: a
// checkpoint's meta.textproto and the run log's config line.
v1::RunConfig RunConfigFor(const TrainerOptions& options, int64_t step);

struct StepResult {
  int64_t step = 0;  // 1-based
  double lr = 0;
  double loss = 0;  // task + every auxiliary term
  double task = 0;  // cross entropy; perplexity = exp(task)
  double load = 0, intra = 0, inter = 0, z = 0, balance = 0;
  double grad_norm = 0;  // before clipping, over dense and every expert shard
  int64_t tokens = 0;
  double seconds = 0;
  double flops = 0;           // model FLOPs: tokens x TrainingFlopsPerToken
  double machine_gflops = 0;  // TrainerOptions::machine_gflops
  std::vector<router::RoutingStats> layers;  // per MoE layer, last micro-batch
  // Remote experts: per group, the bytes of rows, outputs and gradients the
  // step sent and received (ExpertBackend::Traffic); empty in process.
  std::vector<RowTraffic> traffic;
  // Remote experts: the step's Forward calls' waits (ExpertBackend::Waits).
  ForwardWaits waits;
  // Data parallel: the ranks, and this rank's gradient all-reduce (its wall
  // time, after its backward, and the bytes it summed).
  int ranks = 1;
  double allreduce_seconds = 0;
  int64_t allreduce_bytes = 0;

  double gflops() const { return seconds > 0 ? flops / seconds / 1e9 : 0; }
  // Model FLOPs utilisation: achieved over the machine's GEMM rate; 0 when
  // that rate is unknown.
  double mfu() const { return machine_gflops > 0 ? gflops() / machine_gflops : 0; }
};

struct EvalResult {
  double loss = 0;  // mean cross entropy over the validation windows
  // Per MoE layer, over every validation batch (router::MergeRoutingStats).
  std::vector<router::RoutingStats> layers;
};

// Trains the LM: dense parts and routers here, experts in the backend.
// One optimizer step = grad_accum micro-batches, one global grad-norm clip
// over all shards, AdamW on both sides, then the routers' bias updates
// (loss_free, the balance controller).
class Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const TrainerOptions& options);
  ~Trainer();

  absl::StatusOr<StepResult> Step();
  // After a Step that failed before it updated anything (a group failed in a
  // forward or backward pass, or in the gradient norm): whether
  // RetryFailedStep may run it again.
  bool failed_step_retryable() const { return retry_.has_value(); }
  // Readies the failed step to run again as if it had not run: every group
  // drops what it kept of it (Abort), the batches it drew are drawn again.
  // FAILED_PRECONDITION when a group no longer serves this run (restarted
  // without a run state file: its weights are lost) or is not at the last
  // step (restarted on an older run state file); the step is then not
  // retryable: recover from a checkpoint. UNAVAILABLE or DEADLINE_EXCEEDED
  // when one cannot be reached yet (it stays retryable).
  absl::Status RetryFailedStep();
  // Mean cross entropy and routing statistics over the fixed validation
  // windows.
  absl::StatusOr<EvalResult> Evaluate();

  int64_t step() const { return step_; }
  // For checkpoint/resume.
  void set_step(int64_t step) { step_ = step; }
  torch::optim::AdamW& optimizer() { return *optimizer_; }
  BatchSampler& sampler() { return *sampler_; }
  model::TransformerLM& model() { return *model_; }
  BackendMoE& moe() { return *moe_; }
  ExpertBackend& experts() { return *experts_; }
  const Corpus& corpus() const { return *corpus_; }
  const TrainerOptions& options() const { return options_; }
  const std::string& run_id() const { return options_.run_id; }
  double flops_per_token() const { return flops_per_token_; }
  // Micro-batches that run at once in a step (see
  // TrainerOptions::micro_batches_in_flight): 1 in process or without
  // accumulation.
  int micro_batches_in_flight() const { return lanes_ == nullptr ? 1 : lanes_in_flight_; }
  int rank() const { return data_parallel_ == nullptr ? 0 : data_parallel_->rank(); }
  // Whether this rank loads a checkpoint's expert state: all but the ranks
  // after 0 that share remote groups with it.
  bool restores_experts() const { return !SharedGroups() || rank() == 0; }
  int world_size() const { return data_parallel_ == nullptr ? 1 : data_parallel_->world_size(); }

 private:
  explicit Trainer(const TrainerOptions& options);
  // The step's micro-batches, micro_batches_in_flight() at once: forward,
  // backward, and their losses and tokens added to `r`.
  absl::Status MicroBatchesAtOnce(uint64_t step, StepResult& r);
  // This rank's next batch (see TrainerOptions::data_parallel).
  Batch NextBatch();
  // Across ranks: every gradient and the step's losses and tokens summed.
  absl::Status SumOverRanks(StepResult& r);
  // Ranks sharing remote groups: rank 0 reads their gradient norm and steps
  // them, for every rank.
  bool SharedGroups() const { return world_size() > 1 && options_.remote_experts; }
  absl::StatusOr<double> ExpertGradNormSquared();
  absl::Status StepExperts(uint64_t step, const AdamWHyper& hyper, double scale);

  TrainerOptions options_;
  std::unique_ptr<Corpus> corpus_;
  std::unique_ptr<BatchSampler> sampler_;
  std::unique_ptr<EvalWindows> eval_;
  std::unique_ptr<ExpertBackend> experts_;
  std::unique_ptr<BackendMoE> moe_;  // over experts_
  std::shared_ptr<model::TransformerLM> model_;  // over moe_
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  int64_t step_ = 0;
  // The step that failed before updating anything, and the sampler's state
  // before it drew its batches.
  struct Retry {
    uint64_t step = 0;
    std::string sampler_state;
  };
  std::optional<Retry> retry_;
  double flops_per_token_ = 0;
  // With micro-batches at once: their turns, and the threads of every lane
  // but the caller's.
  std::unique_ptr<MicroBatchTurns> turns_;
  std::unique_ptr<ComputePool> lanes_;
  int lanes_in_flight_ = 1;
  DataParallel* data_parallel_ = nullptr;
};

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_TRAINER_H_
