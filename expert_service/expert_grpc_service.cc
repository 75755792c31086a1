#include "expert_service/expert_grpc_service.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "common/host_port.h"
#include "common/status_macros.h"
#include "expert_service/expert_access.h"
#include "expert_service/state_stream.h"
#include "proto/grpc_status.h"
#include "proto/raw_rpc.h"

namespace himoe::expert {
namespace {

using Clock = std::chrono::system_clock;

// Queues `work` on `pool`. It is handed OK, or DEADLINE_EXCEEDED when the
// call's deadline passed while it waited (it must not compute then). A full
// queue is returned at once, and `work` never runs.
absl::Status SubmitBeforeDeadline(ComputePool* pool, Clock::time_point deadline,
                                  std::function<void(const absl::Status&)> work) {
  return pool->Submit([deadline, work = std::move(work)] {
    if (deadline <= Clock::now()) {
      work(absl::DeadlineExceededError(
          "the call's deadline passed while it waited for a compute worker; not computed"));
      return;
    }
    work(absl::OkStatus());
  });
}

// Streams the chunks of a state snapshot. The snapshot is taken on the
// compute pool, in its FIFO order behind the work queued before the call;
// the reactor threads only serialize and write chunks.
class GetStateReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  GetStateReactor(const ExpertServiceCore& core, ComputePool* pool,
                  const v1::GetStateRequest& request, Clock::time_point deadline,
                  int64_t max_chunk_bytes) {
    if (request.chunk_bytes() < 0) {
      Finish(ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "chunk_bytes: ", request.chunk_bytes(), "; expected >= 0 (0 = default)"))));
      return;
    }
    const int64_t chunk_bytes = std::min(
        request.chunk_bytes() == 0 ? kDefaultStateChunkBytes : request.chunk_bytes(),
        max_chunk_bytes);
    const bool include_optimizer = request.include_optimizer();
    const absl::Status queued = SubmitBeforeDeadline(
        pool, deadline,
        [this, &core, include_optimizer, chunk_bytes](const absl::Status& admitted) {
          if (!admitted.ok()) {
            Finish(ToGrpcStatus(admitted));
            return;
          }
          auto state = core.GetState(include_optimizer);
          if (!state.ok()) {
            Finish(ToGrpcStatus(state.status()));
            return;
          }
          auto chunker = StateChunker::Create(std::move(*state), chunk_bytes);
          if (!chunker.ok()) {
            Finish(ToGrpcStatus(chunker.status()));
            return;
          }
          chunker_ = std::move(*chunker);
          NextWrite();
        });
    if (!queued.ok()) Finish(ToGrpcStatus(queued));
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "GetState: stream broken"));
      return;
    }
    NextWrite();
  }

  void OnDone() override { delete this; }

 private:
  void NextWrite() {
    if (!chunker_->Next(&chunk_)) {
      Finish(grpc::Status::OK);
      return;
    }
    if (grpc::Status s = SerializeRaw(chunk_, &buffer_); !s.ok()) {
      Finish(s);
      return;
    }
    StartWrite(&buffer_);
  }

  std::unique_ptr<StateChunker> chunker_;
  v1::StateChunk chunk_;
  grpc::ByteBuffer buffer_;
};

// Assembles the streamed chunks (on the reactor threads: parsing and
// copying bytes) and applies them all at once at the end, on the compute pool.
class SetStateReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  SetStateReactor(grpc::CallbackServerContext* context, ExpertServiceCore* core,
                  ComputePool* pool, grpc::ByteBuffer* response)
      : context_(context),
        core_(core),
        pool_(pool),
        response_(response),
        assembler_([core](const std::string& name, c10::ScalarType dtype,
                          at::IntArrayRef shape) {
          return core->ValidateStateTensor(name, dtype, shape);
        }) {
    StartRead(&buffer_);
  }

  void OnReadDone(bool ok) override {
    if (ok) {
      chunk_.Clear();
      absl::Status status =
          ParseRaw(buffer_, absl::StrCat("state chunk ", assembler_.chunks()).c_str(), &chunk_);
      if (status.ok()) status = assembler_.Add(chunk_);
      served_ = served_ || chunk_.served();
      if (!status.ok()) {
        Finish(ToGrpcStatus(status));
        return;
      }
      StartRead(&buffer_);
      return;
    }
    // End of the client's stream. A cancelled stream must not apply the
    // tensors that happened to be complete (best effort: the cancellation may
    // only be visible later, as with any race against a client).
    if (context_->IsCancelled()) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "SetState: cancelled"));
      return;
    }
    const absl::Status queued =
        SubmitBeforeDeadline(pool_, context_->deadline(), [this](const absl::Status& admitted) {
          if (!admitted.ok()) {
            Finish(ToGrpcStatus(admitted));
            return;
          }
          if (context_->IsCancelled()) {
            Finish(grpc::Status(grpc::StatusCode::CANCELLED, "SetState: cancelled"));
            return;
          }
          Apply();
        });
    if (!queued.ok()) Finish(ToGrpcStatus(queued));
  }

  void OnDone() override { delete this; }

 private:
  void Apply() {
    auto tensors = assembler_.Finish();
    if (!tensors.ok()) {
      Finish(ToGrpcStatus(tensors.status()));
      return;
    }
    std::string fingerprint;
    const absl::Status status = core_->SetState(*tensors, served_, &fingerprint);
    if (!status.ok()) {
      Finish(ToGrpcStatus(status));
      return;
    }
    v1::SetStateResponse response;
    response.set_tensors(static_cast<int32_t>(tensors->size()));
    response.set_weights_fingerprint(fingerprint);
    Finish(SerializeRaw(response, response_));
  }

  grpc::CallbackServerContext* context_;
  ExpertServiceCore* core_;
  ComputePool* pool_;
  grpc::ByteBuffer* response_;
  StateAssembler assembler_;
  grpc::ByteBuffer buffer_;
  v1::StateChunk chunk_;
  bool served_ = false;
};

}  // namespace

ExpertGrpcService::ExpertGrpcService(ExpertServiceCore* core, ComputePool* pool,
                                     int64_t max_chunk_bytes,
                                     std::shared_ptr<const AccessPolicy> policy)
    : core_(core),
      pool_(pool),
      max_chunk_bytes_(std::max<int64_t>(max_chunk_bytes, 1)),
      policy_(std::move(policy)) {}

absl::Status ExpertGrpcService::Admit(grpc::CallbackServerContext* context,
                                      const char* method) const {
  if (policy_ == nullptr) return absl::OkStatus();
  return policy_->Check(ExpertMethodPath(method), CallerOf(*context));
}

grpc::ServerUnaryReactor* ExpertGrpcService::Refuse(grpc::CallbackServerContext* context,
                                                    const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

template <class Request, class Response, class Compute>
grpc::ServerUnaryReactor* ExpertGrpcService::ServeOnPool(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request,
                                                         grpc::ByteBuffer* response,
                                                         Compute compute,
                                                         std::function<void()> after) {
  const Clock::time_point deadline = context->deadline();
  return ServeUnary<Request, Response>(
      context, request, response,
      [this, deadline, compute, after](Request* q, Response* r,
                                       std::function<void(const absl::Status&)> done) {
        // `done` keeps the request and response alive until it is called.
        const absl::Status queued = SubmitBeforeDeadline(
            pool_, deadline, [q, r, done, compute, after](const absl::Status& admitted) {
              done(admitted.ok() ? compute(q, r) : admitted);
              if (after) after();
            });
        if (!queued.ok()) done(queued);
      });
}

grpc::ServerUnaryReactor* ExpertGrpcService::Info(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response) {
  if (absl::Status s = Admit(context, "Info"); !s.ok()) return Refuse(context, s);
  return ServeUnarySync<v1::ExpertInfoRequest, v1::ExpertInfoResponse>(
      context, request, response, [this](const auto&, auto* r) {
        core_->FillInfo(r);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* ExpertGrpcService::Forward(grpc::CallbackServerContext* context,
                                                     const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* response) {
  // A training Forward (save_for_backward) also needs what a Backward does.
  absl::Status training;
  if (policy_ != nullptr) {
    const Caller caller = CallerOf(*context);
    const absl::Status serving = policy_->Check(ExpertMethodPath("Forward"), caller);
    if (!serving.ok()) return Refuse(context, serving);
    training = policy_->Check(ExpertMethodPath("Backward"), caller);
  }
  return ServeOnPool<v1::ExpertForwardRequest, v1::ExpertForwardResponse>(
      context, request, response, [this, training](auto* q, auto* r) {
        if (q->save_for_backward() && !training.ok()) {
          return absl::PermissionDeniedError(
              absl::StrCat("save_for_backward: a training Forward is authorized as a Backward; ",
                           training.message()));
        }
        return core_->Forward(q, r);
      });
}

grpc::ServerUnaryReactor* ExpertGrpcService::Backward(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request,
                                                      grpc::ByteBuffer* response) {
  if (absl::Status s = Admit(context, "Backward"); !s.ok()) return Refuse(context, s);
  // The weight gradients after the answer: the caller goes on meanwhile. An
  // error there stays with the core and fails the next Backward or Step.
  return ServeOnPool<v1::ExpertBackwardRequest, v1::ExpertBackwardResponse>(
      context, request, response, [this](auto* q, auto* r) { return core_->Backward(q, r); },
      [this] { core_->RunPendingWeightGrads().IgnoreError(); });
}

grpc::ServerUnaryReactor* ExpertGrpcService::Step(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response) {
  if (absl::Status s = Admit(context, "Step"); !s.ok()) return Refuse(context, s);
  return ServeOnPool<v1::ExpertStepRequest, v1::ExpertStepResponse>(
      context, request, response, [this](auto* q, auto* r) { return core_->Step(*q, r); });
}

grpc::ServerUnaryReactor* ExpertGrpcService::Abort(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  if (absl::Status s = Admit(context, "Abort"); !s.ok()) return Refuse(context, s);
  // Inline: freeing a step's saved state must get through a full queue.
  return ServeUnarySync<v1::ExpertAbortRequest, v1::ExpertAbortResponse>(
      context, request, response, [this](const auto& q, auto* r) { return core_->Abort(q, r); });
}

grpc::ServerUnaryReactor* ExpertGrpcService::BeginRun(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request,
                                                      grpc::ByteBuffer* response) {
  if (absl::Status s = Admit(context, "BeginRun"); !s.ok()) return Refuse(context, s);
  return ServeOnPool<v1::BeginRunRequest, v1::BeginRunResponse>(
      context, request, response, [this](auto* q, auto* r) { return core_->BeginRun(*q, r); });
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* ExpertGrpcService::GetState(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request) {
  if (absl::Status s = Admit(context, "GetState"); !s.ok()) {
    return RejectStream<grpc::ServerWriteReactor<grpc::ByteBuffer>>(ToGrpcStatus(s));
  }
  v1::GetStateRequest request;
  if (absl::Status s = ParseRaw(*raw_request, "request", &request); !s.ok()) {
    return RejectStream<grpc::ServerWriteReactor<grpc::ByteBuffer>>(ToGrpcStatus(s));
  }
  return new GetStateReactor(*core_, pool_, request, context->deadline(), max_chunk_bytes_);
}

grpc::ServerReadReactor<grpc::ByteBuffer>* ExpertGrpcService::SetState(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  if (absl::Status s = Admit(context, "SetState"); !s.ok()) {
    return RejectStream<grpc::ServerReadReactor<grpc::ByteBuffer>>(ToGrpcStatus(s));
  }
  return new SetStateReactor(context, core_, pool_, response);
}

absl::StatusOr<std::unique_ptr<ExpertServer>> ExpertServer::Start(
    const ExpertServerOptions& options) {
  if (options.max_message_bytes < 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes: ", options.max_message_bytes, "; expected >= 1024"));
  }
  HIMOE_ASSIGN_OR_RETURN(const HostPort listen, ParseHostPort("address", options.address));
  HIMOE_ASSIGN_OR_RETURN(const std::shared_ptr<grpc::ServerCredentials> credentials,
                         MakeServerCredentials(options.tls));
  std::unique_ptr<ExpertServer> server(new ExpertServer());
  HIMOE_ASSIGN_OR_RETURN(server->core_, ExpertServiceCore::Create(options.core));
  if (!options.state_file.empty()) {
    HIMOE_RETURN_IF_ERROR(LoadStateFromFile(options.state_file, server->core_.get()));
  }
  if (!options.run_state_file.empty()) {
    const v1::ExpertShape& shape = options.core.shape;
    HIMOE_ASSIGN_OR_RETURN(const std::optional<RunSnapshot> run,
                           ReadRunStateFile(options.run_state_file, shape, options.core.group_id));
    if (run.has_value()) {
      const absl::Status restored = server->core_->RestoreRun(*run);
      if (!restored.ok()) {
        return absl::Status(
            restored.code(),
            absl::StrCat("run state file '", options.run_state_file, "': ", restored.message()));
      }
      server->restored_step_ = run->last_applied_step;
    }
    server->run_state_ =
        std::make_unique<RunStateWriter>(options.run_state_file, shape, options.core.group_id);
    server->core_->set_run_snapshot_sink(
        [writer = server->run_state_.get()](RunSnapshot s) { writer->Submit(std::move(s)); });
  }
  // Leaves room for the chunk's name, shape and framing.
  HIMOE_ASSIGN_OR_RETURN(server->pool_, ComputePool::Create(options.compute));
  server->service_ = std::make_unique<ExpertGrpcService>(
      server->core_.get(), server->pool_.get(), options.max_message_bytes - 512, options.policy);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // One process per port: with SO_REUSEPORT a second server on a taken port
  // would share its connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Clients' keepalive pings (ExpertGroupClientOptions::keepalive) are
  // answered however often they come, idle or not, never with a GOAWAY.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 50);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.AddListeningPort(JoinHostPort(listen.host, listen.port), credentials, &server->port_);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    if (server->server_ != nullptr) server->server_->Shutdown();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on '", options.address, "'"));
  }
  server->address_ = JoinHostPort(listen.host, server->port_);
  if (grpc::HealthCheckServiceInterface* health =
          server->server_->GetHealthCheckService()) {
    health->SetServingStatus(v1::ExpertService::service_full_name(), true);
    health->SetServingStatus(true);
  }
  return server;
}

ExpertServer::~ExpertServer() {
  Shutdown();
  Wait();
}

void ExpertServer::Shutdown(absl::Duration deadline) {
  if (server_ == nullptr) return;
  std::call_once(shutdown_once_, [&] {
    if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
      health->Shutdown();
    }
    server_->Shutdown(std::chrono::system_clock::now() +
                      absl::ToChronoMicroseconds(deadline));
  });
}

absl::Status ExpertServer::FlushRunState() {
  return run_state_ == nullptr ? absl::OkStatus() : run_state_->Flush();
}

void ExpertServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace himoe::expert
