#ifndef HIMOE_ROUTER_SERVICE_REMOTE_MOE_H_
#define HIMOE_ROUTER_SERVICE_REMOTE_MOE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "router_service/group_client.h"
#include "router_service/local_moe.h"
#include "router_service/router_layer.h"
#include "router_service/router_metrics.h"

namespace himoe::router {

// Appends rows [begin, end) of a group's expert-sorted rows to `out`, one
// ExpertRows per run of equal expert ids (`experts` is on the CPU).
absl::Status AppendExpertRuns(const at::Tensor& rows, const std::vector<int64_t>& experts,
                              int64_t begin, int64_t end,
                              google::protobuf::RepeatedPtrField<v1::ExpertRows>* out);

// Concatenates the rows of `parts` into one [n, d_model] tensor, checking
// that part i has as many rows as `expected[i]`.
absl::StatusOr<at::Tensor> ConcatExpertRows(
    const google::protobuf::RepeatedPtrField<v1::ExpertRows>& parts,
    const google::protobuf::RepeatedPtrField<v1::ExpertRows>& expected, int64_t d_model,
    absl::string_view what);

struct RemoteMoEOptions {
  RoutingConfig routing;
  int64_t d_model = 0;
  int num_layers = 1;
  uint64_t seed = 0;                      // gate seeds, as LocalMoE's
  std::vector<GroupClientOptions> groups;  // one per group, in group order
  c10::ScalarType wire_dtype = c10::kFloat;  // kFloat or kBFloat16
  // Rows go out in Forward messages of at most about this many bytes, all in
  // flight at once: loopback gRPC slows down sharply for multi-MiB messages.
  int64_t chunk_bytes = 1 << 20;
};

// MoE layers whose experts live on remote expert-group services: routes
// locally, sends every group's rows concurrently, combines. Serving only
// (eval mode: the EMA is never updated).
class RemoteMoE {
 public:
  static absl::StatusOr<std::unique_ptr<RemoteMoE>> Create(
      const RemoteMoEOptions& options);

  absl::StatusOr<MoEOutput> Forward(int layer, const at::Tensor& x);

  RouterLayer& router(int layer) { return *routers_.at(layer); }
  GroupClient& group(int g) { return *groups_[g]; }
  int num_layers() const { return static_cast<int>(routers_.size()); }
  const RemoteMoEOptions& options() const { return options_; }
  // Not owned; may be null. Set before serving.
  void set_observer(ForwardObserver* observer) { observer_ = observer; }

 private:
  explicit RemoteMoE(const RemoteMoEOptions& options) : options_(options) {}

  RemoteMoEOptions options_;
  std::vector<std::unique_ptr<RouterLayer>> routers_;
  std::vector<std::unique_ptr<GroupClient>> groups_;
  std::atomic<uint64_t> next_request_id_{1};
  ForwardObserver* observer_ = nullptr;
};

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_REMOTE_MOE_H_
