#ifndef HIMOE_COMMON_CLUSTER_CONFIG_H_
#define HIMOE_COMMON_CLUSTER_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/tls_files.h"
#include "himoe/v1/cluster.pb.h"

namespace himoe {

// Parses a cluster file (protobuf text format) and validates it; errors name
// the file and the field. Defaults are filled in (see cluster.proto). Load
// makes the tls paths relative to the file's folder.
absl::StatusOr<v1::ClusterConfig> LoadClusterConfig(const std::string& path);
absl::StatusOr<v1::ClusterConfig> ParseClusterConfig(absl::string_view text,
                                                     absl::string_view origin);

// The threads of a service himoe-cluster starts from `cluster`: `configured`
// (a group's or the router's `threads`), or for 0 an equal share of this
// host's cores among the groups and the router, at least 1.
int ServiceThreads(const v1::ClusterConfig& cluster, int configured);

// The threads of the services himoe-cluster starts on this host from
// `cluster`: its groups here and, with any, the router; 0 when none is here.
int LocalServiceThreads(const v1::ClusterConfig& cluster);

// Why some of `cluster`'s expert compute is not on this host's CPU (a group on
// another host or a GPU), or "" when all of it is.
std::string ExpertsOffThisHostCpu(const v1::ClusterConfig& cluster);

enum class ClusterRole { kExpert, kTrainer, kRouter };
// The TLS files of `role`'s process in `cluster`: `flags` when any is set
// (the command line overrides the file), else the cluster file's `tls`, with
// the role's own certificate when the file names one.
TlsFiles ClusterTls(const v1::ClusterConfig& cluster, const TlsFiles& flags = TlsFiles(),
                    ClusterRole role = ClusterRole::kExpert);

}  // namespace himoe

#endif  // HIMOE_COMMON_CLUSTER_CONFIG_H_
