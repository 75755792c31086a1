#ifndef HIMOE_PROTO_RAW_RPC_H_
#define HIMOE_PROTO_RAW_RPC_H_

#include <chrono>
#include <functional>
#include <memory>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "proto/grpc_status.h"

namespace himoe {

// Methods registered raw (the generated WithRawCallbackMethod_*) parse their
// own requests, so that bytes that are not the request message get
// INVALID_ARGUMENT naming the message type. (The typed callback API answers
// them with UNIMPLEMENTED and an empty message.)

// Parses `raw` (left intact) into `message`; INVALID_ARGUMENT
// "<what>: N bytes do not parse as <type>" when it does not.
template <class Message>
absl::Status ParseRaw(const grpc::ByteBuffer& raw, const char* what, Message* message) {
  grpc::ByteBuffer bytes(raw);  // shares the slices
  const size_t size = bytes.Length();
  if (grpc::SerializationTraits<Message>::Deserialize(&bytes, message).ok()) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", size, " bytes do not parse as ",
                                                 Message::descriptor()->full_name()));
}

// Replaces what `raw` holds (gRPC's serializer needs an empty buffer).
template <class Message>
grpc::Status SerializeRaw(const Message& message, grpc::ByteBuffer* raw) {
  raw->Clear();
  bool own_buffer = false;
  return grpc::SerializationTraits<Message>::Serialize(message, raw, &own_buffer);
}

// A streaming reactor that only finishes with `status` (a rejected request).
template <class Reactor>
Reactor* RejectStream(const grpc::Status& status) {
  class Rejected final : public Reactor {
   public:
    explicit Rejected(const grpc::Status& s) { this->Finish(s); }
    void OnDone() override { delete this; }
  };
  return new Rejected(status);
}

// Serves a unary RPC registered raw: parses the request (ParseRaw), then
// `handle(request, response, done)` runs; `done(status)` may be called from
// any thread, once: it serializes the response when the status is OK and
// finishes the call. The request is the call's own until `done`, so the
// handler may take its bytes (TakeTensor). A call whose deadline passed
// before it got here is not handled.
template <class Request, class Response>
grpc::ServerUnaryReactor* ServeUnary(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response,
    const std::function<void(Request*, Response*, std::function<void(const absl::Status&)>)>&
        handle) {
  struct Call {
    Request request;
    Response response;
  };
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto call = std::make_shared<Call>();
  if (absl::Status parsed = ParseRaw(*raw_request, "request", &call->request); !parsed.ok()) {
    reactor->Finish(ToGrpcStatus(parsed));
    return reactor;
  }
  if (context->deadline() <= std::chrono::system_clock::now()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                 "the call's deadline passed before it was served; not computed"));
    return reactor;
  }
  handle(&call->request, &call->response, [call, reactor, raw_response](const absl::Status& s) {
    grpc::Status status = ToGrpcStatus(s);
    if (status.ok()) status = SerializeRaw(call->response, raw_response);
    reactor->Finish(status);
  });
  return reactor;
}

// The synchronous form: `handle(request, response)` returns the status.
template <class Request, class Response, class Handle>
grpc::ServerUnaryReactor* ServeUnarySync(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* raw_request,
                                         grpc::ByteBuffer* raw_response, Handle handle) {
  return ServeUnary<Request, Response>(
      context, raw_request, raw_response,
      [&handle](Request* request, Response* response,
                std::function<void(const absl::Status&)> done) {
        done(handle(std::as_const(*request), response));
      });
}

}  // namespace himoe

#endif  // HIMOE_PROTO_RAW_RPC_H_
