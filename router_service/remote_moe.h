#ifndef HIMOE_ROUTER_SERVICE_REMOTE_MOE_H_
#define HIMOE_ROUTER_SERVICE_REMOTE_MOE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "expert_service/expert_client.h"
#include "expert_service/shared_regions.h"
#include "himoe/v1/model.pb.h"
#include "model/moe_layers.h"
#include "router_service/routing/local_moe.h"
#include "router_service/routing/router_layer.h"

namespace himoe::router {

// Receives what one RemoteMoE forward did; implemented by RouterMetrics.
class ForwardObserver {
 public:
  virtual ~ForwardObserver() = default;
  virtual void OnRouted(int layer, const RoutingStats& stats) = 0;
  virtual void OnGroupDispatch(int group, double seconds, int64_t rows) = 0;
  // A group's answer came from other weights than the router loaded or
  // checked (its outputs were refused); then whether reloading them worked.
  virtual void OnWeightsChanged(int group) = 0;
  virtual void OnExpertsReloaded(int group, bool ok) = 0;
};

struct RemoteMoEOptions {
  RoutingConfig routing;
  // The served experts: N and M must match `routing`; d_model, num_layers and
  // the seed (of the gates, as LocalMoE's) come from here.
  v1::ExpertShape shape;
  std::vector<expert::ExpertGroupClientOptions> groups;  // one per group, in order
  c10::ScalarType wire_dtype = c10::kFloat;               // kFloat or kBFloat16
  // Rows go out in Forward messages of at most about this many bytes, each
  // sent as soon as it is built. A service computes a group's messages one
  // after another, so smaller ones cost it GEMM efficiency; larger ones slow
  // loopback gRPC down (docs/benchmarks.md, "Serving").
  int64_t chunk_bytes = 4 << 20;
  // The rows and outputs go through POSIX shared memory, and each message
  // carries only where: every group must run on this host with
  // --shared_memory. A call that finds its group's regions all leased (more
  // than kSharedRegionsPerGroup calls in flight) sends its bytes inline.
  bool shared_memory = false;
  // The groups serve a model as they are (a checkpoint's experts already in
  // them): pin each replica's weights from VerifyGroups' Info, or else its
  // first answer. Weights LoadExpertState pushes are pinned either way;
  // unpinned groups are served whatever they hold (a trainer may be
  // training them).
  bool pin_weights = false;
  // A group found serving other weights than those LoadExpertState pushed
  // gets them pushed again (the call that found it fails UNAVAILABLE, to be
  // retried); LoadExpertState then also accepts a group that cannot be
  // reached yet, which gets them once it answers.
  bool reload_changed_experts = false;
};

// MoE layers whose experts live on remote expert-group services: routes
// locally, sends every group's rows concurrently, combines. Serving only
// (eval mode: the EMA is never updated); a training call is refused.
//
// The weights it loads (LoadExpertState), or with pin_weights the weights the
// groups serve, are pinned per replica (ExpertGroupClient::PinWeights): an
// answer from other weights fails its call with FAILED_PRECONDITION, so a
// served model never changes silently.
class RemoteMoE final : public model::MoELayers {
 public:
  static absl::StatusOr<std::unique_ptr<RemoteMoE>> Create(const RemoteMoEOptions& options);

  // Shared-memory regions a group keeps at most (RemoteMoEOptions.shared_memory).
  static constexpr size_t kSharedRegionsPerGroup = 8;

  // Every group call ends by `deadline` at the latest (besides each group's
  // own deadline). `segments`: the row counts of the requests merged into x
  // (RouterLayer::Route), routed each as if alone.
  absl::StatusOr<MoEOutput> Forward(
      int layer, const at::Tensor& x,
      expert::ExpertGroupClient::Deadline deadline = expert::ExpertGroupClient::Deadline::max(),
      const std::vector<int64_t>& segments = {});

  // model::MoELayers
  int num_layers() const override { return static_cast<int>(routers_.size()); }
  int num_groups() const override { return static_cast<int>(groups_.size()); }
  absl::StatusOr<MoEOutput> Forward(int layer, const at::Tensor& x,
                                    const model::MoECall& call) override;
  RouterLayer& router(int layer) override { return *routers_.at(layer); }
  absl::Status LoadExpertState(int group, const std::vector<NamedTensor>& state) override;

  // The Info handshake with every address of every group (replicas too), each
  // within `timeout`: FailedPrecondition naming the address and the fields
  // when one serves other experts (another seed, dtype, size, group). An
  // address that does not answer is skipped: it may come up later. With
  // pin_weights, pins the weights each one reports.
  absl::Status VerifyGroups(std::chrono::milliseconds timeout);

  expert::ExpertGroupClient& group(int g) { return *groups_[g]; }
  // Null unless options().shared_memory.
  const expert::SharedRegionPool* shared_regions() const { return regions_.get(); }
  const RemoteMoEOptions& options() const { return options_; }
  // Not owned; may be null. Set before serving.
  void set_observer(ForwardObserver* observer) { observer_ = observer; }

 private:
  struct ChunkCall;
  using ChunkCalls = std::vector<std::unique_ptr<ChunkCall>>;
  struct InFlight;

  explicit RemoteMoE(const RemoteMoEOptions& options) : options_(options) {}
  // Every group's dispatched rows, as Forward messages of at most chunk_bytes,
  // each sent as soon as it is built. On an error, the calls sent so far stay
  // in `flight` (CollectOutputs waits for them).
  absl::Status BuildAndSend(int layer, const at::Tensor& x, const RoutingOutput& routing,
                            expert::ExpertGroupClient::Deadline deadline, InFlight* flight);
  // Waits for every call sent and decodes each in call order as it arrives;
  // each group's outputs, row-aligned with its dispatch (undefined if none),
  // or the first error in call order.
  absl::StatusOr<std::vector<at::Tensor>> CollectOutputs(InFlight* flight);
  // Pushes loaded_ again to the replicas found serving other weights. False
  // when a push failed (or, with none left to push, the latest one did).
  bool ReloadChanged();

  RemoteMoEOptions options_;
  std::vector<std::unique_ptr<RouterLayer>> routers_;
  std::vector<std::unique_ptr<expert::ExpertGroupClient>> groups_;
  std::unique_ptr<expert::SharedRegionPool> regions_;  // null: shared memory off
  std::atomic<uint64_t> next_request_id_{1};
  ForwardObserver* observer_ = nullptr;
  std::mutex reload_mu_;  // held while reloading
  std::mutex changed_mu_;
  std::vector<std::pair<int, size_t>> changed_;   // guarded by changed_mu_: (group, replica)
  std::vector<std::vector<NamedTensor>> loaded_;  // guarded by reload_mu_; by group
  bool last_reload_ok_ = false;                   // guarded by reload_mu_
};

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_REMOTE_MOE_H_
