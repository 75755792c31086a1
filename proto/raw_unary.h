#ifndef HIMOE_PROTO_RAW_UNARY_H_
#define HIMOE_PROTO_RAW_UNARY_H_

#include <chrono>
#include <functional>
#include <memory>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "proto/grpc_status.h"

namespace himoe {

// Serves a unary RPC registered raw (the generated WithRawCallbackMethod_*):
// the request is parsed here, so bytes that are not a `Request` get
// INVALID_ARGUMENT naming the message type. (The typed callback API answers
// them with UNIMPLEMENTED and an empty message.) Then `handle(request,
// response, done)` runs; `done(status)` may be called from any thread, once:
// it serializes the response when the status is OK and finishes the call. A
// call whose deadline passed before it got here is not handled.
template <class Request, class Response>
grpc::ServerUnaryReactor* ServeUnary(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* raw_request,
    grpc::ByteBuffer* raw_response,
    const std::function<void(const Request&, Response*,
                             std::function<void(const absl::Status&)>)>& handle) {
  struct Call {
    Request request;
    Response response;
  };
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto call = std::make_shared<Call>();
  grpc::ByteBuffer bytes(*raw_request);  // shares the slices
  const size_t size = bytes.Length();
  if (!grpc::SerializationTraits<Request>::Deserialize(&bytes, &call->request).ok()) {
    reactor->Finish(grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("request: ", size, " bytes do not parse as ",
                     Request::descriptor()->full_name())));
    return reactor;
  }
  if (context->deadline() <= std::chrono::system_clock::now()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                 "the call's deadline passed before it was served; not computed"));
    return reactor;
  }
  handle(call->request, &call->response, [call, reactor, raw_response](const absl::Status& s) {
    grpc::Status status = ToGrpcStatus(s);
    if (status.ok()) {
      bool own_buffer = false;
      status = grpc::SerializationTraits<Response>::Serialize(call->response, raw_response,
                                                              &own_buffer);
    }
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
      [&handle](const Request& request, Response* response,
                std::function<void(const absl::Status&)> done) {
        done(handle(request, response));
      });
}

}  // namespace himoe

#endif  // HIMOE_PROTO_RAW_UNARY_H_
