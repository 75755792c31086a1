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

// The threads of a service himoe-cluster starts from `cluster`: `configured`
// (a group's or the router's `threads`), or for 0 an equal share of this
// host's cores among the groups and the router, at least 1.
int ServiceThreads(const v1::ClusterConfig& cluster, int configured);

}  // namespace himoe

#endif  // HIMOE_COMMON_CLUSTER_CONFIG_H_
