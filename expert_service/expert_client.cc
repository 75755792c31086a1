#include "expert_service/expert_client.h"

#include <algorithm>
#include <mutex>
#include <utility>

#include <glog/logging.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/countdown.h"
#include "common/expert_shape.h"
#include "common/status_macros.h"
#include "expert_service/expert_rows.h"
#include "expert_service/state_stream.h"
#include "proto/grpc_status.h"

namespace himoe::expert {

// Counts the contexts alive (calls_in_flight()); the client's destructor
// waits for the count to reach 0.
struct ContextDeleter {
  std::atomic<int>* live;
  std::mutex* mu;
  std::condition_variable* released;
  void operator()(grpc::ClientContext* context) const {
    delete context;
    std::lock_guard<std::mutex> lock(*mu);
    live->fetch_sub(1, std::memory_order_relaxed);
    released->notify_all();
  }
};

struct ExpertGroupClient::Call {
  Start start;
  bool failover = true;
  Done done;
  // Moves the answer the call received into the caller's message (null: none).
  std::function<void()> deliver;
  size_t replica = 0;
  ExpertGroupClient::Deadline deadline = ExpertGroupClient::Deadline::max();
  // Checks an OK answer from replica `replica` (null: none).
  std::function<absl::Status(size_t replica)> check;
  std::unique_ptr<grpc::ClientContext, ContextDeleter> context;
  std::string errors;  // of replicas tried so far
  // The attempt's number and start in attempts_, why the liveness check
  // cancelled it (empty: it did not), and whether `done` ran or is about to
  // (the liveness check reports a stalled call without waiting for gRPC to
  // give it back: a call whose bytes are stuck in a stalled connection's
  // write completes only when the connection fails). Guarded by live_mu_.
  uint64_t attempt = 0;
  std::chrono::steady_clock::time_point started;
  std::string stalled;
  bool reported = false;
};

// One health check in flight to a replica.
struct ExpertGroupClient::Probe {
  // Released (with its reference to the channel) before the probe is
  // forgotten, as a call's context is before its `done`.
  std::unique_ptr<grpc::ClientContext> context = std::make_unique<grpc::ClientContext>();
  // grpc.health.v1.HealthCheckRequest{service: ""}: no bytes (one empty slice;
  // a default ByteBuffer is no message at all).
  grpc::Slice no_bytes;
  grpc::ByteBuffer request{&no_bytes, 1};
  grpc::ByteBuffer response;
  std::chrono::steady_clock::time_point sent;
};

namespace {

constexpr char kHealthCheck[] = "/grpc.health.v1.Health/Check";

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertGroupClient>> ExpertGroupClient::Create(
    const ExpertGroupClientOptions& options) {
  if (options.addresses.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("group ", options.group_id, ": no address given"));
  }
  std::unique_ptr<ExpertGroupClient> client(new ExpertGroupClient(options));
  HIMOE_ASSIGN_OR_RETURN(const std::shared_ptr<grpc::ChannelCredentials> credentials,
                         MakeChannelCredentials(options.tls));
  for (const std::string& address : options.addresses) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(options.max_message_bytes);
    args.SetMaxSendMessageSize(options.max_message_bytes);
    // Reconnect quickly once a group comes back. (Not
    // GRPC_ARG_MIN_RECONNECT_BACKOFF_MS: it is gRPC's minimum connect timeout,
    // 20 s by default; at 100 ms a handshake on a loaded machine misses it.)
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    if (options.keepalive.count() > 0) {
      const int ms = static_cast<int>(options.keepalive.count());
      args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ms);
      args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ms);
      args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
      args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    }
    auto channel =
        grpc::CreateCustomChannel(address, credentials, args);
    client->stubs_.push_back(v1::ExpertService::NewStub(channel));
    client->health_stubs_.push_back(std::make_unique<grpc::GenericStub>(channel));
    client->channels_.push_back(std::move(channel));
  }
  client->probes_.resize(options.addresses.size());
  client->silent_.resize(options.addresses.size(), false);
  if (options.liveness_check.count() > 0) {
    client->watcher_ = std::thread([c = client.get()] { c->WatchLiveness(); });
  }
  return client;
}

ExpertGroupClient::~ExpertGroupClient() {
  std::unique_lock<std::mutex> lock(live_mu_);
  stopping_ = true;
  live_cv_.notify_all();
  for (const auto& probe : probes_) {
    if (probe != nullptr) probe->context->TryCancel();
  }
  // A call the liveness check reported may still be held by gRPC until its
  // connection fails (keepalive's TCP user time-out).
  live_cv_.wait(lock, [&] {
    return calls_in_flight_.load(std::memory_order_relaxed) == 0 &&
           std::none_of(probes_.begin(), probes_.end(), [](const auto& p) { return p != nullptr; });
  });
  lock.unlock();
  if (watcher_.joinable()) watcher_.join();
}

void ExpertGroupClient::WatchLiveness() {
  const auto period = options_.liveness_check;
  std::unique_lock<std::mutex> lock(live_mu_);
  while (!live_cv_.wait_for(lock, period / 4, [&] { return stopping_; })) {
    const auto now = std::chrono::steady_clock::now();
    std::vector<bool> overdue(channels_.size(), false);
    // A call to a group that left its last check unanswered is checked at
    // once: a step's later calls to a stalled group are found as soon.
    for (const auto& [number, call] : attempts_) {
      if (silent_[call->replica] || now - call->started >= period) overdue[call->replica] = true;
    }
    for (size_t r = 0; r < overdue.size(); ++r) {
      if (overdue[r] && probes_[r] == nullptr) StartProbe(r);
    }
  }
}

// Called with live_mu_ held.
void ExpertGroupClient::StartProbe(size_t replica) {
  auto probe = std::make_shared<Probe>();
  probe->sent = std::chrono::steady_clock::now();
  probe->context->set_deadline(std::chrono::system_clock::now() + options_.liveness_check);
  probes_[replica] = probe;
  // The callback runs on a gRPC thread, never inside this call.
  health_stubs_[replica]->UnaryCall(
      probe->context.get(), kHealthCheck, grpc::StubOptions(), &probe->request, &probe->response,
      [this, replica, probe](grpc::Status status) {
        std::vector<std::pair<Done, absl::Status>> report;
        std::unique_lock<std::mutex> lock(live_mu_);
        // Any answer, NOT_SERVING while it drains or an error, is
        // from a live process; no answer in time is the failure.
        const bool silent = status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
        const bool was_silent = silent_[replica];
        silent_[replica] = silent;
        if (silent && !stopping_) {
          const double waited =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - probe->sent).count();
          const std::string why = absl::StrFormat(
              "no answer to a health check within %.2f s while a call was in flight "
              "(a stopped process, or a cut or stalled link)",
              waited);
          int cancelled = 0;
          for (auto& [number, call] : attempts_) {
            if (call->replica != replica || !call->stalled.empty()) continue;
            call->stalled = why;
            liveness_failures_.fetch_add(1, std::memory_order_relaxed);
            call->context->TryCancel();
            ++cancelled;
            // With no replica left to try, the caller hears of it now.
            if (!call->reported && !(call->failover && call->replica + 1 < stubs_.size())) {
              call->reported = true;
              report.emplace_back(
                  call->done, absl::UnavailableError(
                                  absl::StrCat("expert group ", options_.group_id, " unreachable (",
                                               call->errors, call->errors.empty() ? "" : "; ",
                                               options_.addresses[replica], ": ", why, ")")));
            }
          }
          if (cancelled > 0 || !was_silent) {
            LOG(WARNING) << "expert group " << options_.group_id << " at "
                         << options_.addresses[replica] << ": " << why << "; " << cancelled
                         << " calls cancelled";
          }
        }
        probe->context.reset();
        probes_[replica] = nullptr;
        live_cv_.notify_all();
        lock.unlock();
        for (auto& [done, failed] : report) done(std::move(failed));
      });
}

void ExpertGroupClient::ForwardAsync(const v1::ExpertForwardRequest* request,
                                     v1::ExpertForwardResponse* response, Done done,
                                     Deadline deadline) {
  auto call = std::make_shared<Call>();
  // The call receives into its own message, handed over in `deliver`: a
  // call reported before gRPC gave it back must not write the caller's.
  auto answer = std::make_shared<v1::ExpertForwardResponse>();
  call->start = [this, request, answer](v1::ExpertService::Stub* stub, grpc::ClientContext* context,
                                        std::function<void(grpc::Status)> on_status) {
    answer->Clear();
    rows_sent_.fetch_add(RowBytes(*request), std::memory_order_relaxed);
    stub->async()->Forward(context, request, answer.get(),
                           [this, answer, on_status = std::move(on_status)](grpc::Status s) {
                             if (s.ok()) {
                               rows_received_.fetch_add(RowBytes(*answer),
                                                        std::memory_order_relaxed);
                             }
                             on_status(std::move(s));
                           });
  };
  call->deliver = [answer, response] { response->Swap(answer.get()); };
  call->failover = true;
  call->done = std::move(done);
  call->deadline = deadline;
  call->check = [this, response](size_t replica) {
    return CheckWeights(replica, response->weights_fingerprint());
  };
  Attempt(std::move(call));
}

absl::Status ExpertGroupClient::CheckWeights(size_t replica, const std::string& served) {
  std::string pinned;
  {
    std::lock_guard<std::mutex> lock(pins_mu_);
    if (pins_[replica].empty() && options_.pin_weights) pins_[replica] = served;
    pinned = pins_[replica];
  }
  if (pinned.empty() || pinned == served) return absl::OkStatus();
  if (on_weights_changed_) on_weights_changed_(replica, served);
  return absl::FailedPreconditionError(absl::StrCat(
      "expert group ", options_.group_id, " at ", options_.addresses[replica],
      ": weights_fingerprint: it serves weights '", served, "', not the '", pinned,
      "' this client loaded or checked (a BeginRun, SetState or Step since, or a restart); "
      "its outputs are refused"));
}

void ExpertGroupClient::PinWeights(size_t replica, const std::string& fingerprint) {
  std::lock_guard<std::mutex> lock(pins_mu_);
  if (replica < pins_.size()) pins_[replica] = fingerprint;
}

std::string ExpertGroupClient::pinned_weights(size_t replica) const {
  std::lock_guard<std::mutex> lock(pins_mu_);
  return replica < pins_.size() ? pins_[replica] : "";
}

void ExpertGroupClient::BackwardAsync(const v1::ExpertBackwardRequest* request,
                                      v1::ExpertBackwardResponse* response, Done done) {
  auto answer = std::make_shared<v1::ExpertBackwardResponse>();
  StartCall(
      [this, request, answer](v1::ExpertService::Stub* stub, grpc::ClientContext* context,
                              std::function<void(grpc::Status)> on_status) {
        answer->Clear();
        rows_sent_.fetch_add(RowBytes(*request), std::memory_order_relaxed);
        stub->async()->Backward(context, request, answer.get(),
                                [this, answer, on_status = std::move(on_status)](grpc::Status s) {
                                  if (s.ok()) {
                                    rows_received_.fetch_add(RowBytes(*answer),
                                                             std::memory_order_relaxed);
                                  }
                                  on_status(std::move(s));
                                });
      },
      /*failover=*/false, std::move(done), [answer, response] { response->Swap(answer.get()); });
}

void ExpertGroupClient::StepAsync(const v1::ExpertStepRequest* request,
                                  v1::ExpertStepResponse* response, Done done) {
  auto answer = std::make_shared<v1::ExpertStepResponse>();
  StartCall(
      [request, answer](v1::ExpertService::Stub* stub, grpc::ClientContext* context,
                        std::function<void(grpc::Status)> on_status) {
        answer->Clear();
        stub->async()->Step(context, request, answer.get(), std::move(on_status));
      },
      /*failover=*/false, std::move(done), [answer, response] { response->Swap(answer.get()); });
}

void ExpertGroupClient::StartCall(Start start, bool failover, Done done,
                                  std::function<void()> deliver) {
  auto call = std::make_shared<Call>();
  call->start = std::move(start);
  call->failover = failover;
  call->done = std::move(done);
  call->deliver = std::move(deliver);
  Attempt(std::move(call));
}

void ExpertGroupClient::Attempt(std::shared_ptr<Call> call) {
  calls_in_flight_.fetch_add(1, std::memory_order_relaxed);
  call->context = std::unique_ptr<grpc::ClientContext, ContextDeleter>(
      new grpc::ClientContext, ContextDeleter{&calls_in_flight_, &live_mu_, &live_cv_});
  call->context->set_deadline(
      std::min(call->deadline, std::chrono::system_clock::now() + options_.deadline));
  if (options_.liveness_check.count() > 0) {
    std::lock_guard<std::mutex> lock(live_mu_);
    call->attempt = next_attempt_++;
    call->started = std::chrono::steady_clock::now();
    call->stalled.clear();
    call->reported = false;
    attempts_[call->attempt] = call.get();
  }
  call->start(stubs_[call->replica].get(), call->context.get(), [this, call](grpc::Status status) {
    bool reported = false;
    if (options_.liveness_check.count() > 0) {
      std::lock_guard<std::mutex> lock(live_mu_);
      attempts_.erase(call->attempt);
      if (!call->stalled.empty() && status.error_code() == grpc::StatusCode::CANCELLED) {
        status = grpc::Status(grpc::StatusCode::UNAVAILABLE, call->stalled);
      }
      if (status.ok()) silent_[call->replica] = false;
      reported = call->reported;
      call->reported = true;  // from here on this completion reports it
    }
    // The context holds a reference to the channel. Released before `done`,
    // it cannot be the channel's last: otherwise a client destroyed as soon
    // as `done` returns leaves the channel to die here, on gRPC's callback
    // thread, which then ends (and frees) gRPC's callback queue under itself
    // when it was the last one using it: the intermittent "double free" at
    // the trainer's exit.
    call->context.reset();
    if (reported) return;  // the liveness check reported it
    if (status.ok()) {
      if (call->deliver) call->deliver();
      call->done(call->check ? call->check(call->replica) : absl::OkStatus());
      return;
    }
    absl::StrAppend(&call->errors, call->errors.empty() ? "" : "; ",
                    options_.addresses[call->replica], ": ", status.error_message());
    // This client cancels a call only for its liveness check (UNAVAILABLE by
    // now): a CANCELLED one was cancelled by the group, shutting down, and is
    // as lost as an unreachable one.
    const bool cancelled = status.error_code() == grpc::StatusCode::CANCELLED;
    const bool retriable = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                           status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED || cancelled;
    if (retriable && call->failover && call->replica + 1 < stubs_.size()) {
      ++call->replica;
      Attempt(call);
      return;
    }
    // Input errors come back as they are; transport errors name the group.
    const absl::Status s =
        cancelled ? absl::UnavailableError("cancelled by the group") : FromGrpcStatus(status);
    call->done(retriable ? absl::Status(s.code(), absl::StrCat("expert group ", options_.group_id,
                                                               " unreachable (", call->errors, ")"))
                         : Named(status, call->replica));
  });
}

absl::Status ExpertGroupClient::Named(const grpc::Status& status, size_t replica) const {
  const absl::Status s = FromGrpcStatus(status);
  return absl::Status(s.code(), absl::StrCat("expert group ", options_.group_id, " at ",
                                             options_.addresses[replica], ": ", s.message()));
}

absl::StatusOr<v1::ExpertInfoResponse> ExpertGroupClient::Info() {
  size_t replica = 0;
  return InfoFrom(&replica);
}

absl::StatusOr<v1::ExpertInfoResponse> ExpertGroupClient::InfoFrom(size_t* replica) {
  std::string errors;
  for (size_t r = 0; r < stubs_.size(); ++r) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + options_.deadline);
    v1::ExpertInfoResponse response;
    const grpc::Status status = stubs_[r]->Info(&context, v1::ExpertInfoRequest(), &response);
    if (status.ok()) {
      *replica = r;
      Answered(r);
      return response;
    }
    absl::StrAppend(&errors, errors.empty() ? "" : "; ", options_.addresses[r], ": ",
                    status.error_message());
  }
  return absl::UnavailableError(
      absl::StrCat("expert group ", options_.group_id, " unreachable (", errors, ")"));
}

absl::Status ExpertGroupClient::CheckInfo(const v1::ExpertShape& expected,
                                          v1::ExpertInfoResponse* answer) {
  size_t replica = 0;
  HIMOE_ASSIGN_OR_RETURN(const v1::ExpertInfoResponse info, InfoFrom(&replica));
  if (answer != nullptr) *answer = info;
  const std::string where = absl::StrCat("expert service at ", options_.addresses[replica]);
  if (info.group_id() != options_.group_id) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, " serves group ", info.group_id(), "; expected group ", options_.group_id));
  }
  return CheckExpertShape(expected, info.shape(),
                          absl::StrCat(where, " (group ", options_.group_id, ")"));
}

absl::StatusOr<v1::ExpertAbortResponse> ExpertGroupClient::Abort(
    uint64_t step, const std::string& run_id, std::chrono::milliseconds deadline) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       (deadline.count() > 0 ? deadline : options_.deadline));
  v1::ExpertAbortRequest request;
  request.set_step(step);
  request.set_run_id(run_id);
  v1::ExpertAbortResponse response;
  const grpc::Status status = stubs_[0]->Abort(&context, request, &response);
  if (!status.ok()) return Named(status, 0);
  Answered(0);
  return response;
}

void ExpertGroupClient::Answered(size_t replica) {
  std::lock_guard<std::mutex> lock(live_mu_);
  silent_[replica] = false;
}

bool ExpertGroupClient::Connected() const {
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    if (silent_[0]) return false;
  }
  return channels_[0]->GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_READY;
}

absl::StatusOr<v1::BeginRunResponse> ExpertGroupClient::BeginRun(const std::string& run_id,
                                                                 bool take_over, int world_size) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + options_.deadline);
  v1::BeginRunRequest request;
  request.set_run_id(run_id);
  request.set_take_over(take_over);
  request.set_world_size(static_cast<uint32_t>(world_size));
  v1::BeginRunResponse response;
  const grpc::Status status = stubs_[0]->BeginRun(&context, request, &response);
  if (!status.ok()) return Named(status, 0);
  return response;
}

absl::StatusOr<std::vector<NamedTensor>> ExpertGroupClient::GetState(bool include_optimizer) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + options_.deadline);
  v1::GetStateRequest request;
  request.set_include_optimizer(include_optimizer);
  auto reader = stubs_[0]->GetState(&context, request);
  StateAssembler assembler;
  absl::Status assembled;
  for (v1::StateChunk chunk; reader->Read(&chunk);) {
    if (assembled.ok()) assembled = assembler.Add(chunk);
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return Named(status, 0);
  HIMOE_RETURN_IF_ERROR(assembled);
  return assembler.Finish();
}

absl::Status ExpertGroupClient::SetState(const std::vector<NamedTensor>& state,
                                         int64_t chunk_bytes) {
  return StreamState(state, chunk_bytes, /*served=*/false, /*replica=*/0).status();
}

absl::StatusOr<std::string> ExpertGroupClient::ServeState(const std::vector<NamedTensor>& state,
                                                          size_t replica, int64_t chunk_bytes) {
  return StreamState(state, chunk_bytes, /*served=*/true, replica);
}

absl::StatusOr<std::string> ExpertGroupClient::StreamState(const std::vector<NamedTensor>& state,
                                                           int64_t chunk_bytes, bool served,
                                                           size_t replica) {
  if (replica >= stubs_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("replica: ", replica, " of ", stubs_.size()));
  }
  HIMOE_ASSIGN_OR_RETURN(auto chunker, StateChunker::Create(state, chunk_bytes));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + options_.deadline);
  v1::SetStateResponse response;
  auto writer = stubs_[replica]->SetState(&context, &response);
  for (v1::StateChunk chunk; chunker->Next(&chunk);) {
    chunk.set_served(served);
    if (!writer->Write(chunk)) break;  // the server ended the stream early
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (!status.ok()) return Named(status, replica);
  return response.weights_fingerprint();
}

absl::Status FanOut(size_t n,
                    const std::function<void(size_t i, ExpertGroupClient::Done done)>& start) {
  if (n == 0) return absl::OkStatus();
  Countdown pending(static_cast<int>(n));
  std::mutex mu;
  absl::Status first;  // guarded by mu
  for (size_t i = 0; i < n; ++i) {
    start(i, [&](absl::Status s) {
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first.ok()) first = std::move(s);
      }
      pending.Done();
    });
  }
  pending.Wait();
  return first;
}

}  // namespace himoe::expert
