#ifndef HIMOE_ROUTER_SERVICE_GROUP_CLIENT_H_
#define HIMOE_ROUTER_SERVICE_GROUP_CLIENT_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/channel.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "himoe/v1/expert.grpc.pb.h"

namespace himoe::router {

struct GroupClientOptions {
  int group_id = 0;
  // The group's address first, then its replicas, tried in order.
  std::vector<std::string> addresses;
  std::chrono::milliseconds deadline{10000};
  int max_message_bytes = 64 << 20;
};

// Client of one expert group (and its replicas). Calls are asynchronous
// (callback stubs); a call that fails with UNAVAILABLE or DEADLINE_EXCEEDED
// moves on to the next replica. Errors name the group and the address.
class GroupClient {
 public:
  static absl::StatusOr<std::unique_ptr<GroupClient>> Create(
      const GroupClientOptions& options);

  using Done = std::function<void(absl::Status)>;
  // Start a call; `done` runs once, on a gRPC thread. `request` and
  // `response` must outlive the call. Forward fails over to replicas; the
  // training calls (Backward, Step, Abort) stay on the first address, which
  // holds the saved activations and the optimizer.
  void ForwardAsync(const v1::ExpertForwardRequest* request,
                    v1::ExpertForwardResponse* response, Done done);
  void BackwardAsync(const v1::ExpertBackwardRequest* request,
                     v1::ExpertBackwardResponse* response, Done done);
  void StepAsync(const v1::ExpertStepRequest* request, v1::ExpertStepResponse* response,
                 Done done);

  // Blocking calls (first address; Info fails over).
  absl::StatusOr<v1::ExpertInfoResponse> Info();
  absl::StatusOr<v1::ExpertAbortResponse> Abort(uint64_t step);
  absl::StatusOr<std::vector<v1::StateChunk>> GetState(bool include_optimizer);
  absl::Status SetState(const std::vector<v1::StateChunk>& chunks);

  int group_id() const { return options_.group_id; }
  const std::vector<std::string>& addresses() const { return options_.addresses; }

 private:
  struct Call;
  // Issues the RPC on a stub with a fresh context; `on_status` gets its status.
  using Start = std::function<void(v1::ExpertService::Stub*, grpc::ClientContext*,
                                   std::function<void(grpc::Status)>)>;
  explicit GroupClient(const GroupClientOptions& options) : options_(options) {}
  void StartCall(Start start, bool failover, Done done);
  void Attempt(std::shared_ptr<Call> call);
  absl::Status Named(const grpc::Status& status, size_t replica) const;

  GroupClientOptions options_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::ExpertService::Stub>> stubs_;
};

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_GROUP_CLIENT_H_
