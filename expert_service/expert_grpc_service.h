#ifndef HIMOE_EXPERT_SERVICE_EXPERT_GRPC_SERVICE_H_
#define HIMOE_EXPERT_SERVICE_EXPERT_GRPC_SERVICE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/access_policy.h"
#include "common/compute_pool.h"
#include "expert_service/expert_service_core.h"
#include "expert_service/run_state_file.h"
#include "himoe/v1/expert.grpc.pb.h"
#include "proto/tls_credentials.h"

namespace himoe::expert {

using ExpertServiceBase = v1::ExpertService::WithRawCallbackMethod_Info<
    v1::ExpertService::WithRawCallbackMethod_Forward<
        v1::ExpertService::WithRawCallbackMethod_Backward<
            v1::ExpertService::WithRawCallbackMethod_Step<
                v1::ExpertService::WithRawCallbackMethod_Abort<
                    v1::ExpertService::WithRawCallbackMethod_BeginRun<
                        v1::ExpertService::WithRawCallbackMethod_GetState<
                            v1::ExpertService::WithRawCallbackMethod_SetState<
                                v1::ExpertService::CallbackService>>>>>>>>;

// The gRPC adapter over ExpertServiceCore: decode, call the core, encode.
class ExpertGrpcService final : public ExpertServiceBase {
 public:
  // `core` and `pool` must outlive the service. GetState chunks are capped
  // at max_chunk_bytes so that each fits in one message. Forward, Backward,
  // Step and BeginRun compute on `pool`, off gRPC's threads, and so do
  // GetState's snapshot and SetState's apply (the chunks' bytes are
  // serialized and parsed on gRPC's threads).
  // `policy` (may be null: every caller may call every method) decides who
  // may call what (ExpertAccessPolicy); a call it refuses is
  // PERMISSION_DENIED and reaches no core.
  ExpertGrpcService(ExpertServiceCore* core, ComputePool* pool, int64_t max_chunk_bytes,
                    std::shared_ptr<const AccessPolicy> policy = nullptr);

  // Every method is registered raw: bytes that do not parse as the request
  // message (or a SetState chunk) get INVALID_ARGUMENT naming it (ParseRaw).
  grpc::ServerUnaryReactor* Info(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Backward(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Step(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context,
                                  const grpc::ByteBuffer* request,
                                  grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* BeginRun(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  // Streams v1::StateChunk messages.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* GetState(
      grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) override;
  // Reads v1::StateChunk messages; answers a v1::SetStateResponse.
  grpc::ServerReadReactor<grpc::ByteBuffer>* SetState(
      grpc::CallbackServerContext* context, grpc::ByteBuffer* response) override;

 private:
  // Parses the request, then runs `compute(request, response)` on the pool
  // and finishes from there: a full queue is RESOURCE_EXHAUSTED at once, and
  // a call whose deadline passed while it waited is not computed. `after`
  // (if set) runs on the same worker once the call is answered.
  template <class Request, class Response, class Compute>
  grpc::ServerUnaryReactor* ServeOnPool(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response, Compute compute,
                                        std::function<void()> after = nullptr);
  // OK when the policy lets the caller call `method`.
  absl::Status Admit(grpc::CallbackServerContext* context, const char* method) const;
  // A finished call (refused).
  static grpc::ServerUnaryReactor* Refuse(grpc::CallbackServerContext* context,
                                          const absl::Status& status);

  ExpertServiceCore* core_;
  ComputePool* pool_;
  int64_t max_chunk_bytes_;
  std::shared_ptr<const AccessPolicy> policy_;
};

struct ExpertServerOptions {
  ExpertServiceOptions core;
  std::string address = "127.0.0.1:0";  // host:port or [v6]:port; port 0 picks one
  int max_message_bytes = 64 << 20;     // receive and send
  // Optional: a state file (SaveStateToFile) loaded before serving.
  std::string state_file;
  // Optional: a run state file (run_state_file.h). Restored before serving
  // when it exists (after state_file), rewritten after every applied Step.
  std::string run_state_file;
  // Mutual TLS (empty = plaintext): clients need a certificate of the CA.
  TlsFiles tls;
  // Who may call what (ExpertAccessPolicy); null: every caller, every method.
  std::shared_ptr<const AccessPolicy> policy;
  // Where Forward, Backward and Step compute: workers, and how many calls
  // may wait for one before RESOURCE_EXHAUSTED.
  ComputePoolOptions compute{1, 256, "--max_queue"};
};

// A running himoe-expert gRPC server (ExpertService, health, reflection).
class ExpertServer {
 public:
  static absl::StatusOr<std::unique_ptr<ExpertServer>> Start(
      const ExpertServerOptions& options);
  ExpertServer(const ExpertServer&) = delete;
  ExpertServer& operator=(const ExpertServer&) = delete;
  ~ExpertServer();  // Shutdown() then Wait()

  int port() const { return port_; }
  // The bound address, "host:port" with the port actually chosen.
  const std::string& address() const { return address_; }
  ExpertServiceCore* core() { return core_.get(); }
  // The step whose run state the file held at start; nullopt without one.
  std::optional<uint64_t> restored_step() const { return restored_step_; }
  // Waits until the run state of every applied Step is on disk (OK at once
  // without a run state file).
  absl::Status FlushRunState();
  ComputePool& compute_pool() { return *pool_; }

  // Reports NOT_SERVING, stops accepting calls, and cancels calls still
  // running after `deadline`. Idempotent, thread-safe.
  void Shutdown(absl::Duration deadline = absl::Seconds(5));
  // Blocks until the server has shut down.
  void Wait();

 private:
  ExpertServer() = default;

  std::unique_ptr<ExpertServiceCore> core_;
  // Null without a run state file; goes after pool_'s last Step.
  std::unique_ptr<RunStateWriter> run_state_;
  std::unique_ptr<ComputePool> pool_;  // runs what is queued before core_ goes
  std::unique_ptr<ExpertGrpcService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  int port_ = 0;
  std::optional<uint64_t> restored_step_;
  std::once_flag shutdown_once_;
};

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_EXPERT_GRPC_SERVICE_H_
