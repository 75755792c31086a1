#ifndef HIMOE_TRAINER_EXPERT_BACKEND_H_
#define HIMOE_TRAINER_EXPERT_BACKEND_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "common/named_tensor.h"
#include "himoe/v1/model.pb.h"
#include "proto/tls_credentials.h"

namespace himoe::trainer {

struct AdamWHyper {
  double lr = 0;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
};

// One group's share of an MoE layer with each token once
// (router::DistinctTokenRows), whatever the number of its experts chosen.
struct GroupRows {
  at::Tensor rows;             // float [u, d]: the distinct token rows
  at::Tensor assignment_rows;  // int64 [n]: each assignment's row of `rows`
  at::Tensor expert_ids;       // int64 [n]: ascending, all in the group
  at::Tensor weights;          // float [n]: the assignments' combine weights
  // Training: this micro-batch's place among the step's micro-batches that
  // send this group rows of this layer (0, 1, ...), in micro-batch order;
  // the group adds their expert gradients in that order, whatever order
  // their Backwards come in. -1: arrival order.
  int64_t grad_position = -1;
};

// Bytes of rows, outputs and gradients that went to and came from one group.
struct RowTraffic {
  int64_t sent = 0;
  int64_t received = 0;
};

// Forward calls to the groups so far: per call, the wait for the slowest
// group's answer, and that minus the mean of the groups' (the time the
// others' rows sit idle behind a straggler).
struct ForwardWaits {
  int64_t calls = 0;
  double slowest_seconds = 0;
  double straggler_seconds = 0;
};

// Where a model's experts live. "layer" counts MoE layers only. Every group
// holds experts [g*S, (g+1)*S) of every MoE layer.
class ExpertBackend {
 public:
  virtual ~ExpertBackend() = default;

  // Experts of `layer` on each group's rows: per group, float [u_g, d], each
  // row's sum over its assignments of weight * expert(row) (undefined for a
  // group without rows). Differentiable w.r.t. the rows and the weights when
  // `training`.
  virtual absl::StatusOr<std::vector<at::Tensor>> Forward(int layer, uint64_t step,
                                                          uint32_t micro_batch,
                                                          const std::vector<GroupRows>& groups,
                                                          bool training) = 0;
  // Per group, what crossed the link since creation (remote groups only;
  // empty in process).
  virtual std::vector<RowTraffic> Traffic() const { return {}; }
  // Remote groups only (zero in process).
  virtual ForwardWaits Waits() const { return {}; }
  // The experts' parameters when they live in this process, whose gradients
  // a data-parallel step sums over the ranks; empty for remote groups.
  virtual std::vector<at::Tensor> LocalParameters() const { return {}; }
  // Sum over every expert shard of ||grad||^2.
  virtual absl::StatusOr<double> GradNormSquared() = 0;
  // AdamW on every shard with the gradients scaled by `grad_scale` (the global
  // clip scale). Idempotent per step id: a retried step is not applied twice,
  // and a group that did not apply it (nor had already) is an error.
  virtual absl::Status Step(uint64_t step, const AdamWHyper& hyper, double grad_scale) = 0;
  // Drops whatever a failed step left behind.
  virtual absl::Status Abort(uint64_t step) = 0;
  // Abort on the groups reachable now, at once after a failure: one whose
  // connection is down is not waited for (the recovery aborts the step there
  // once it serves again; otherwise its saved state expires).
  virtual void AbortWhereReachable(uint64_t step) = 0;
  // OK if every group serves this run with `step` as its last applied step;
  // FAILED_PRECONDITION naming a group that does not (one restarted on a run
  // state file written before its last step).
  virtual absl::Status CheckLastApplied(uint64_t step) = 0;
  // A group's weights and optimizer state, for checkpoints.
  virtual absl::StatusOr<std::vector<NamedTensor>> GetState(int group) = 0;
  virtual absl::Status SetState(int group, const std::vector<NamedTensor>& state) = 0;
  // Saved Forward states not yet consumed by Backward, over all groups.
  virtual absl::StatusOr<int64_t> PendingSaved() = 0;
  virtual int num_groups() const = 0;
};

struct ExpertBackendOptions {
  v1::ExpertShape shape;
  c10::Device device = c10::Device(c10::kCPU);
  // Remote only: one address per group.
  std::vector<std::string> addresses;
  std::chrono::milliseconds deadline{60000};
  // Remote only: ExpertGroupClientOptions::keepalive and liveness_check of
  // every group's client.
  std::chrono::milliseconds keepalive{0};
  // Remote only: mutual TLS to every group (empty = plaintext).
  TlsFiles tls;
  // Remote only: when set, Create begins this training run on every group
  // (BeginRun: seed weights, zero optimizer state, no saved Forwards) and
  // every Step carries it. Empty: no run is begun (serving, Generate).
  std::string run_id;
  // Remote only, with run_id: begin it even on groups that serve a model a
  // router loaded (ExpertInfoResponse.served). Without it, Create refuses
  // such a cluster, before any group is changed.
  bool take_over_served = false;
  // The dtype of the rows, outputs and gradients between the coordinator and
  // the groups: kFloat, or kBFloat16 (half the bytes; each crossing rounded,
  // and the experts still compute in float32). In process the same roundings
  // are made, so a bf16 run there is the remote run's reference.
  c10::ScalarType wire_dtype = c10::kFloat;
  // Remote only: the rows, outputs and gradients go through POSIX shared
  // memory (one region per group, reused call after call) and gRPC carries
  // references. Every group must run on this host with --shared_memory.
  // Where a region cannot be made, the bytes go in the messages.
  bool shared_memory = false;
  // Remote only: one trainer rank of world_size sharing the groups. Each
  // micro-batch b goes out as b * world_size + rank, unique over the ranks;
  // only the rank with begin_run begins run_id (every rank's calls carry it),
  // and a group adds each rank's expert gradients apart, then in rank order.
  int rank = 0;
  int world_size = 1;
  bool begin_run = true;
  // Remote only: called with (group, RPC name, seconds) after every
  // Forward/Backward/Step call, from gRPC threads.
  std::function<void(int, const std::string&, double)> on_rpc;
};

// All groups in this process (ExpertGroup + ExpertOptimizer per group).
absl::StatusOr<std::unique_ptr<ExpertBackend>> CreateInProcessBackend(
    const ExpertBackendOptions& options);

// Groups on himoe-expert services; checks each service's Info against
// options.shape (group id, sizes, seed, dtype), and begins options.run_id on
// every group when it is set, before returning.
absl::StatusOr<std::unique_ptr<ExpertBackend>> CreateRemoteBackend(
    const ExpertBackendOptions& options);

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_EXPERT_BACKEND_H_
