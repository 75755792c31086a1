#ifndef HIMOE_COMMON_CLUSTER_CONFIG_H_
#define HIMOE_COMMON_CLUSTER_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "himoe/v1/cluster.pb.h"

namespace himoe {

// Parses a cluster file (protobuf text format) and validates it; errors name
// the file and the field. Defaults are filled in (see cluster.proto).
absl::StatusOr<v1::ClusterConfig> LoadClusterConfig(const std::string& path);
absl::StatusOr<v1::ClusterConfig> ParseClusterConfig(absl::string_view text,
                                                     absl::string_view origin);

}  // namespace himoe

#endif  // HIMOE_COMMON_CLUSTER_CONFIG_H_
