#include "router_service/group_client.h"

#include <utility>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/str_cat.h"
#include "proto/grpc_status.h"

namespace himoe::router {

struct GroupClient::Call {
  const v1::ExpertForwardRequest* request;
  v1::ExpertForwardResponse* response;
  ForwardDone done;
  size_t replica = 0;
  std::unique_ptr<grpc::ClientContext> context;
  std::string errors;  // of replicas tried so far
};

absl::StatusOr<std::unique_ptr<GroupClient>> GroupClient::Create(
    const GroupClientOptions& options) {
  if (options.addresses.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("group ", options.group_id, ": no address given"));
  }
  std::unique_ptr<GroupClient> client(new GroupClient(options));
  for (const std::string& address : options.addresses) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(options.max_message_bytes);
    args.SetMaxSendMessageSize(options.max_message_bytes);
    // Reconnect quickly once a group comes back.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    auto channel =
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    client->stubs_.push_back(v1::ExpertService::NewStub(channel));
    client->channels_.push_back(std::move(channel));
  }
  return client;
}

void GroupClient::ForwardAsync(const v1::ExpertForwardRequest* request,
                               v1::ExpertForwardResponse* response,
                               ForwardDone done) {
  auto call = std::make_shared<Call>();
  call->request = request;
  call->response = response;
  call->done = std::move(done);
  Attempt(std::move(call));
}

void GroupClient::Attempt(std::shared_ptr<Call> call) {
  call->context = std::make_unique<grpc::ClientContext>();
  call->context->set_deadline(std::chrono::system_clock::now() + options_.deadline);
  call->response->Clear();
  v1::ExpertService::Stub* stub = stubs_[call->replica].get();
  stub->async()->Forward(
      call->context.get(), call->request, call->response,
      [this, call](grpc::Status status) {
        if (status.ok()) {
          call->done(absl::OkStatus());
          return;
        }
        const std::string& address = options_.addresses[call->replica];
        absl::StrAppend(&call->errors, call->errors.empty() ? "" : "; ", address, ": ",
                        status.error_message());
        const bool retriable = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                               status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
        if (retriable && call->replica + 1 < stubs_.size()) {
          ++call->replica;
          Attempt(call);
          return;
        }
        // Input errors come back as they are; transport errors name the group.
        const absl::Status s = FromGrpcStatus(status);
        call->done(retriable ? absl::Status(s.code(),
                                            absl::StrCat("expert group ", options_.group_id,
                                                         " unreachable (", call->errors, ")"))
                             : absl::Status(s.code(), absl::StrCat("expert group ",
                                                                   options_.group_id, " at ",
                                                                   address, ": ", s.message())));
      });
}

absl::StatusOr<v1::ExpertInfoResponse> GroupClient::Info() {
  std::string errors;
  for (size_t r = 0; r < stubs_.size(); ++r) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + options_.deadline);
    v1::ExpertInfoResponse response;
    const grpc::Status status = stubs_[r]->Info(&context, v1::ExpertInfoRequest(), &response);
    if (status.ok()) return response;
    absl::StrAppend(&errors, errors.empty() ? "" : "; ", options_.addresses[r], ": ",
                    status.error_message());
  }
  return absl::UnavailableError(
      absl::StrCat("expert group ", options_.group_id, " unreachable (", errors, ")"));
}

}  // namespace himoe::router
