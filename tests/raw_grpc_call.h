#ifndef HIMOE_TESTS_RAW_GRPC_CALL_H_
#define HIMOE_TESTS_RAW_GRPC_CALL_H_

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

namespace himoe::testutil {

struct RawCallResult {
  grpc::Status status;
  std::vector<std::string> replies;  // each reply message's bytes
};

// Calls `method` ("/pkg.Service/Method") with `messages` as raw request
// bytes on one stream, half-closes and reads every reply: works for unary and
// streaming methods alike, since the wire format is the same.
RawCallResult RawCall(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                      const std::vector<std::string>& messages);

}  // namespace himoe::testutil

#endif  // HIMOE_TESTS_RAW_GRPC_CALL_H_
