#ifndef HIMOE_ROUTER_SERVICE_ROUTER_GRPC_SERVICE_H_
#define HIMOE_ROUTER_SERVICE_ROUTER_GRPC_SERVICE_H_

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "himoe/v1/router.grpc.pb.h"
#include "proto/tls_credentials.h"
#include "model/moe_layers.h"
#include "model/text_generator.h"
#include "router_service/batched_moe.h"
#include "router_service/batcher.h"
#include "router_service/remote_moe.h"
#include "router_service/router_metrics.h"

namespace himoe::router {

struct RouterServerOptions {
  RemoteMoEOptions moe;
  BatcherOptions batching;
  std::string address = "127.0.0.1:0";
  // Mutual TLS of the RouterService port (empty = plaintext); the calls to the
  // groups use moe.groups[g].tls.
  TlsFiles tls;
  int max_message_bytes = 64 << 20;
  int64_t max_tokens_per_request = 65536;
  // Where the router's metrics go; null = no metrics.
  prometheus::Registry* registry = nullptr;
  int metrics_window_batches = 64;
  // At start, refuse groups that serve other experts (RemoteMoE::VerifyGroups).
  bool verify_groups = true;
  std::chrono::milliseconds verify_timeout{2000};
  // Serves Generate when set: called once the RemoteMoE and the batcher exist,
  // before the port opens, with the router's own (batched) MoE layers, which
  // the language model it returns must use. Without it Generate is
  // FAILED_PRECONDITION.
  std::function<absl::StatusOr<std::shared_ptr<model::TextGenerator>>(model::MoELayers&)>
      make_generator;
};

// The hidden rows of a RouteForward request, as float32 or bfloat16
// [T, d_model] with 1 <= T <= max_tokens, all finite; INVALID_ARGUMENT naming
// the field otherwise. Takes the bytes of request->hidden (no copy).
absl::StatusOr<at::Tensor> DecodeHidden(v1::RouteForwardRequest* request, int64_t d_model,
                                        int64_t max_tokens);

// The RouterService adapter: decode and validate, batch, route and dispatch
// through RemoteMoE, encode.
class RouterGrpcService final
    : public v1::RouterService::WithRawCallbackMethod_Info<
          v1::RouterService::WithRawCallbackMethod_RouteForward<
              v1::RouterService::WithRawCallbackMethod_Generate<
                  v1::RouterService::CallbackService>>> {
 public:
  RouterGrpcService(RemoteMoE* moe, Batcher* batcher, RouterMetrics* metrics,
                    int64_t max_tokens,
                    std::shared_ptr<model::TextGenerator> generator = nullptr)
      : moe_(moe),
        batcher_(batcher),
        metrics_(metrics),
        max_tokens_(max_tokens),
        generator_(std::move(generator)) {
    for (const auto& g : moe->options().groups) {
      request_deadline_ = std::max(request_deadline_, g.deadline);
    }
  }

  // Every method is registered raw: bytes that do not parse as the request
  // message get INVALID_ARGUMENT naming it (ParseRaw).
  grpc::ServerUnaryReactor* Info(grpc::CallbackServerContext* context,
                                 const grpc::ByteBuffer* request,
                                 grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RouteForward(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;
  // Streams v1::GenerateResponse messages.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request) override;

 private:
  absl::Status FillInfo(v1::RouterInfoResponse* response) const;
  // Validates, batches, and calls `done` once (from the batcher's thread
  // when the request was valid).
  void Route(v1::RouteForwardRequest* request, v1::RouteForwardResponse* response,
             Batcher::Deadline deadline, std::function<void(const absl::Status&)> done);

  RemoteMoE* moe_;
  Batcher* batcher_;
  RouterMetrics* metrics_;  // may be null
  int64_t max_tokens_;
  // Bounds a RouteForward from its arrival: the groups' (largest) deadline.
  std::chrono::milliseconds request_deadline_{0};
  std::shared_ptr<model::TextGenerator> generator_;  // may be null
};

// A running router: RemoteMoE + batcher (+ the LM served by Generate) + gRPC
// server with health and reflection.
class RouterServer {
 public:
  static absl::StatusOr<std::unique_ptr<RouterServer>> Start(
      const RouterServerOptions& options);
  ~RouterServer();

  int port() const { return port_; }
  RemoteMoE& moe() { return *moe_; }
  Batcher& batcher() { return *batcher_; }
  // The MoE layers Generate's LM runs on: the batcher, then RemoteMoE.
  model::MoELayers& moe_layers() { return *batched_moe_; }
  // Null without options.make_generator.
  model::TextGenerator* generator() { return generator_.get(); }
  void Shutdown();
  void Wait() { server_->Wait(); }

 private:
  RouterServer() = default;
  absl::Status Listen(const RouterServerOptions& options);

  std::unique_ptr<RouterMetrics> metrics_;
  std::unique_ptr<RemoteMoE> moe_;
  std::unique_ptr<Batcher> batcher_;
  std::unique_ptr<BatchedMoE> batched_moe_;
  std::shared_ptr<model::TextGenerator> generator_;
  std::unique_ptr<RouterGrpcService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::once_flag shutdown_once_;
};

// A Generate request as GenerateParams, validated against `generator`.
absl::StatusOr<model::GenerateParams> DecodeGenerateRequest(
    const v1::GenerateRequest& request, const model::TextGenerator& generator);

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_ROUTER_GRPC_SERVICE_H_
