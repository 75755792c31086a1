#include "router_service/router_grpc_service.h"

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/all_finite.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "common/host_port.h"
#include "common/torch_runtime.h"
#include "proto/grpc_status.h"
#include "proto/raw_rpc.h"

namespace himoe::router {


absl::StatusOr<model::GenerateParams> DecodeGenerateRequest(
    const v1::GenerateRequest& request, const model::TextGenerator& generator) {
  if (!request.prompt().empty() && request.prompt_tokens_size() > 0) {
    return absl::InvalidArgumentError(
        "prompt, prompt_tokens: both are set; send the prompt as bytes or as token ids");
  }
  model::GenerateParams params;
  if (!request.prompt().empty()) {
    if (!generator.byte_level()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt: this model is not byte-level (vocab ", generator.vocab_size(),
          "); send prompt_tokens"));
    }
    for (const char c : request.prompt()) params.prompt.push_back(static_cast<unsigned char>(c));
  } else {
    params.prompt.assign(request.prompt_tokens().begin(), request.prompt_tokens().end());
  }
  params.max_new_tokens = request.max_new_tokens();
  params.temperature = request.temperature();
  params.top_k = request.top_k();
  // float on the wire; 0 is proto3's unset.
  params.top_p = request.top_p() == 0 ? 1.0 : request.top_p();
  params.seed = request.seed();
  if (request.stop_size() > 0 && !generator.byte_level()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stop: this model is not byte-level (vocab ", generator.vocab_size(),
        "); send stop_token_ids"));
  }
  if (request.stop_size() + request.stop_token_ids_size() > model::kMaxStopSequences) {
    return absl::InvalidArgumentError(
        absl::StrCat("stop, stop_token_ids: at most ", model::kMaxStopSequences, " in all, got ",
                     request.stop_size() + request.stop_token_ids_size()));
  }
  for (int i = 0; i < request.stop_size(); ++i) {
    const std::string& seq = request.stop(i);
    if (seq.empty() || seq.size() > static_cast<size_t>(model::kMaxStopTokens)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stop[", i, "]: expected 1 to ", model::kMaxStopTokens, " bytes, got ", seq.size()));
    }
    params.stop.emplace_back();
    for (const char c : seq) params.stop.back().push_back(static_cast<unsigned char>(c));
  }
  for (int i = 0; i < request.stop_token_ids_size(); ++i) {
    const int64_t t = request.stop_token_ids(i);
    if (t < 0 || t >= generator.vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat("stop_token_ids[", i, "]: ", t,
                                                     " is not a token id in [0, ",
                                                     generator.vocab_size(), ")"));
    }
    params.stop.push_back({t});
  }
  HIMOE_RETURN_IF_ERROR(model::ValidateGenerateParams(params, generator));
  return params;
}

namespace {

// Streams what a generation thread samples: the thread queues each token and
// at most one write is in flight. StartWrite and Finish are called without
// the lock held, since gRPC may run reactions inline.
class GenerateReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  GenerateReactor(grpc::CallbackServerContext* context,
                  std::shared_ptr<model::TextGenerator> generator, model::GenerateParams params,
                  RouterMetrics* metrics)
      : context_(context),
        generator_(std::move(generator)),
        byte_level_(generator_->byte_level()),
        metrics_(metrics) {
    if (metrics_ != nullptr) metrics_->OnStream(+1);
    thread_ = std::thread([this, params = std::move(params)] { Run(params); });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) cancelled_.store(true);  // the stream broke
    {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
    }
    Pump();
  }
  void OnCancel() override { cancelled_.store(true); }
  void OnDone() override {
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // Finish ran OnDone inline on the generation thread
    } else {
      thread_.join();
    }
    delete this;
  }

 private:
  void Run(const model::GenerateParams& params) {
    const auto send = [this](int64_t token) {
      if (cancelled_.load()) return false;
      v1::GenerateResponse response;
      response.set_token(token);
      if (byte_level_) response.set_text(std::string(1, static_cast<char>(token)));
      grpc::ByteBuffer bytes;
      if (!SerializeRaw(response, &bytes).ok()) return false;
      if (metrics_ != nullptr) metrics_->OnGeneratedToken();
      {
        std::lock_guard<std::mutex> lock(mu_);
        queue_.push_back(std::move(bytes));
      }
      Pump();
      return true;
    };
    const absl::StatusOr<model::FinishReason> finished =
        model::GenerateUntilStop(*generator_, params, send);
    const absl::Status status = finished.status();
    if (finished.ok()) {
      context_->AddTrailingMetadata("himoe-finish-reason", model::FinishReasonName(*finished));
    }
    if (metrics_ != nullptr) {
      metrics_->OnStream(-1);
      if (!status.ok()) metrics_->OnError(static_cast<int>(status.code()));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      status_ = status;
      generated_ = true;
    }
    Pump();  // may end in Finish: `this` is not touched afterwards
  }

  // Starts the next write, or finishes once everything sampled is written
  // (or the client has gone) and the generation has returned.
  void Pump() {
    enum { kNothing, kWrite, kFinish } action = kNothing;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (writing_ || finished_) return;
      if (!queue_.empty() && !cancelled_.load()) {
        current_ = std::move(queue_.front());
        queue_.pop_front();
        writing_ = true;
        action = kWrite;
      } else if (generated_) {
        finished_ = true;
        action = kFinish;
      }
    }
    if (action == kWrite) StartWrite(&current_);
    if (action == kFinish) Finish(ToGrpcStatus(status_));
  }

  grpc::CallbackServerContext* const context_;
  const std::shared_ptr<model::TextGenerator> generator_;
  const bool byte_level_;
  RouterMetrics* const metrics_;  // may be null
  std::thread thread_;
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  std::deque<grpc::ByteBuffer> queue_;  // serialized v1::GenerateResponse
  grpc::ByteBuffer current_;
  bool writing_ = false;
  bool generated_ = false;
  bool finished_ = false;
  absl::Status status_;
};

}  // namespace

absl::StatusOr<at::Tensor> DecodeHidden(v1::RouteForwardRequest* request, int64_t d_model,
                                        int64_t max_tokens) {
  HIMOE_ASSIGN_OR_RETURN(at::Tensor x, TakeTensor(request->mutable_hidden(), "hidden"));
  if (x.scalar_type() != at::kFloat && x.scalar_type() != at::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hidden.dtype: expected FLOAT32 or BFLOAT16, got ", c10::toString(x.scalar_type())));
  }
  if (x.dim() != 2 || x.size(1) != d_model) {
    return absl::InvalidArgumentError(absl::StrCat("hidden.shape: expected [T, d_model=",
                                                   d_model, "], got [",
                                                   absl::StrJoin(x.sizes(), ", "), "]"));
  }
  if (x.size(0) == 0) {
    return absl::InvalidArgumentError("hidden: empty batch (T = 0); send at least one token");
  }
  if (x.size(0) > max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("hidden: ", x.size(0),
                                                   " tokens exceed the limit of ", max_tokens,
                                                   " per request"));
  }
  bool finite = true;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    finite = AllFinite(x);
    return absl::OkStatus();
  }));
  if (!finite) return absl::InvalidArgumentError("hidden contains NaN or Inf");
  return x;
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* RouterGrpcService::Generate(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request) {
  v1::GenerateRequest request;
  absl::Status status = ParseRaw(*raw_request, "request", &request);
  if (!status.ok()) {
    // reported below
  } else if (generator_ == nullptr) {
    status = absl::FailedPreconditionError(
        "Generate: this router serves no language model; start himoe-router with "
        "--checkpoint <trainer checkpoint>");
  } else if (auto params = DecodeGenerateRequest(request, *generator_); !params.ok()) {
    status = params.status();
  } else {
    return new GenerateReactor(context, generator_, *std::move(params), metrics_);
  }
  if (metrics_ != nullptr) metrics_->OnError(static_cast<int>(status.code()));
  return RejectStream<grpc::ServerWriteReactor<grpc::ByteBuffer>>(ToGrpcStatus(status));
}

grpc::ServerUnaryReactor* RouterGrpcService::Info(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response) {
  return ServeUnarySync<v1::RouterInfoRequest, v1::RouterInfoResponse>(
      context, request, response,
      [this](const v1::RouterInfoRequest&, v1::RouterInfoResponse* r) { return FillInfo(r); });
}

absl::Status RouterGrpcService::FillInfo(v1::RouterInfoResponse* response) const {
  const RoutingConfig& c = moe_->options().routing;
  response->set_method(std::string(RoutingMethodName(c.method)));
  response->set_num_experts(c.num_experts);
  response->set_num_groups(c.num_groups);
  response->set_top_k(c.top_k);
  response->set_d_model(moe_->options().shape.d_model());
  for (int l = 0; l < moe_->num_layers(); ++l) response->add_layers(l);
  for (int g = 0; g < c.num_groups; ++g) {
    response->add_group_addresses(absl::StrJoin(moe_->group(g).addresses(), "|"));
  }
  response->set_version("himoe 0.1");
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* RouterGrpcService::RouteForward(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* request,
                                                          grpc::ByteBuffer* response) {
  return ServeUnary<v1::RouteForwardRequest, v1::RouteForwardResponse>(
      context, request, response,
      [this, context](v1::RouteForwardRequest* q, v1::RouteForwardResponse* r,
                      std::function<void(const absl::Status&)> done) {
        // The whole request (queue, routing, every group call) is bounded by
        // the groups' deadline, or the client's if that comes first.
        Route(q, r, std::min(context->deadline(),
                             std::chrono::system_clock::now() + request_deadline_),
              std::move(done));
      });
}

void RouterGrpcService::Route(v1::RouteForwardRequest* request,
                              v1::RouteForwardResponse* response, Batcher::Deadline deadline,
                              std::function<void(const absl::Status&)> done) {
  const auto start = std::chrono::steady_clock::now();
  RouterMetrics* metrics = metrics_;
  const auto finish = [done = std::move(done), metrics, start](const absl::Status& status) {
    if (metrics != nullptr) {
      metrics->OnRequest(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      if (!status.ok()) metrics->OnError(static_cast<int>(status.code()));
    }
    done(status);
  };
  const int layer = request->layer();
  if (layer < 0 || layer >= moe_->num_layers()) {
    finish(absl::InvalidArgumentError(absl::StrCat(
        "layer: ", layer, " is not served; layers are [0, ", moe_->num_layers(), ")")));
    return;
  }
  auto x = DecodeHidden(request, moe_->options().shape.d_model(), max_tokens_);
  if (!x.ok()) {
    finish(x.status());
    return;
  }
  const c10::ScalarType reply_dtype = x->scalar_type();
  const bool routing = request->return_routing();
  batcher_->Submit(layer, x->to(at::kFloat), [=](absl::StatusOr<LayerResult> result) {
    absl::Status status = result.status();
    if (status.ok()) {
      status = CatchTorchErrors([&] {
        if (AllFinite(result->output)) return absl::OkStatus();
        return absl::InvalidArgumentError(absl::StrCat(
            "layer ", layer, ": the combined output is not finite (NaN or Inf); the hidden "
            "rows (max |x| = ", x->abs().max().item<double>(), ") overflow the gate or the experts"));
      });
    }
    if (status.ok()) {
      status = EncodeTensor(result->output.to(reply_dtype), response->mutable_output());
    }
    if (status.ok() && routing) {
      status = EncodeTensor(result->expert_ids, response->mutable_expert_ids());
      if (status.ok()) status = EncodeTensor(result->weights, response->mutable_weights());
    }
    finish(status);
  }, deadline);
}

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Start(
    const RouterServerOptions& options) {
  HIMOE_RETURN_IF_ERROR(ParseHostPort("address", options.address).status());
  std::unique_ptr<RouterServer> server(new RouterServer());
  HIMOE_ASSIGN_OR_RETURN(server->moe_, RemoteMoE::Create(options.moe));
  RemoteMoE* moe = server->moe_.get();
  if (options.verify_groups) HIMOE_RETURN_IF_ERROR(moe->VerifyGroups(options.verify_timeout));
  BatcherOptions batching = options.batching;
  if (options.registry != nullptr) {
    RouterMetricsOptions mo;
    mo.num_layers = moe->num_layers();
    mo.num_groups = moe->num_groups();
    mo.num_experts = options.moe.routing.num_experts;
    mo.window_batches = options.metrics_window_batches;
    server->metrics_ = std::make_unique<RouterMetrics>(mo, *options.registry);
    moe->set_observer(server->metrics_.get());
    RouterMetrics* metrics = server->metrics_.get();
    batching.on_batch = [metrics](int64_t tokens, int64_t requests) {
      metrics->OnBatch(tokens, requests);
    };
    batching.on_queue_depth = [metrics](int64_t requests) { metrics->OnQueueDepth(requests); };
  }
  server->batcher_ = std::make_unique<Batcher>(
      batching,
      [moe](int layer, const at::Tensor& x, const std::vector<int64_t>& segments,
            Batcher::Deadline deadline) -> absl::StatusOr<LayerResult> {
        // Serving keeps no graph: inference mode also skips the views'
        // autograd metadata and the version counters.
        c10::InferenceMode inference;
        // Each merged request is routed as if alone (capacity per request).
        HIMOE_ASSIGN_OR_RETURN(MoEOutput out, moe->Forward(layer, x, deadline, segments));
        return LayerResult{out.output, out.routing.expert_ids,
                           out.routing.weights.detach().to(at::kFloat)};
      });
  server->batched_moe_ = std::make_unique<BatchedMoE>(moe, server->batcher_.get());
  if (options.make_generator) {
    HIMOE_ASSIGN_OR_RETURN(server->generator_, options.make_generator(*server->batched_moe_));
  }
  server->service_ = std::make_unique<RouterGrpcService>(
      moe, server->batcher_.get(), server->metrics_.get(), options.max_tokens_per_request,
      server->generator_);
  HIMOE_RETURN_IF_ERROR(server->Listen(options));
  return server;
}

absl::Status RouterServer::Listen(const RouterServerOptions& options) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // One process per port: with SO_REUSEPORT a second server on a taken port
  // would share its connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  HIMOE_ASSIGN_OR_RETURN(const std::shared_ptr<grpc::ServerCredentials> credentials,
                         MakeServerCredentials(options.tls));
  builder.AddListeningPort(options.address, credentials, &port_);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(absl::StrCat("router: cannot listen on ", options.address));
  }
  if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(v1::RouterService::service_full_name(), true);
    health->SetServingStatus(true);
  }
  return absl::OkStatus();
}

void RouterServer::Shutdown() {
  if (server_ == nullptr) return;
  std::call_once(shutdown_once_, [&] {
    // NOT_SERVING first, so that health checks see the router going away.
    if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
      health->Shutdown();
    }
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  });
}

RouterServer::~RouterServer() {
  Shutdown();
  if (server_ != nullptr) server_->Wait();
  batcher_.reset();  // drains before the MoE goes away
}

}  // namespace himoe::router
