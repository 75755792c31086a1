#ifndef HIMOE_PROTO_GRPC_STATUS_H_
#define HIMOE_PROTO_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace himoe {

// The one conversion between absl::Status and grpc::Status in the code base.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace himoe

#endif  // HIMOE_PROTO_GRPC_STATUS_H_
