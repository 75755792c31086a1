// himoe-router: grouped top-K routing in front of the expert-group services.
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include <glog/logging.h>
#include <prometheus/registry.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/cluster_config.h"
#include "common/expert_shape.h"
#include "common/host_port.h"
#include "common/metrics_endpoint.h"
#include "common/process_stats.h"
#include "common/service_main.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "model/checkpoint_reader.h"
#include "model/generator.h"
#include "model/model_config.h"
#include "router_service/router_grpc_service.h"

ABSL_FLAG(std::string, cluster, "", "Cluster file (protobuf text format; see deploy/local)");
ABSL_FLAG(std::string, address, "",
          "host:port to listen on; default: router.address of the cluster file");
ABSL_FLAG(std::string, checkpoint, "",
          "Serve Generate from this trainer checkpoint (a step_* directory, or the "
          "checkpoints root: its newest); empty = no Generate");
ABSL_FLAG(bool, load_expert_state, true,
          "With --checkpoint: push the checkpoint's expert weights to the groups at start");
ABSL_FLAG(bool, reload_changed_experts, false,
          "With --load_expert_state: a group found serving other weights than those pushed "
          "(a BeginRun, SetState or restart since) gets them pushed again; the call that "
          "found it fails either way");
ABSL_FLAG(int, max_new_tokens, 4096, "Most tokens one Generate request may ask for");
ABSL_FLAG(bool, kv_cache, true,
          "Generate: keep each stream's attention keys and values; false recomputes the "
          "whole context for every token (the reference, for benches)");
ABSL_FLAG(int32_t, max_streams, 64,
          "Generate streams decoded together (continuous batching); more get "
          "RESOURCE_EXHAUSTED");

namespace himoe::router {
namespace {

ServiceInfo Info() {
  ServiceInfo info;
  info.name = "himoe-router";
  info.usage =
      "Routes tokens to the expert groups of a cluster file (RouteForward) and, with "
      "--checkpoint, samples from a trained LM through them (Generate).\n"
      "  himoe-router --cluster=deploy/local/cluster.textproto "
      "[--checkpoint=runs/main/checkpoints]";
  ServiceFlagHelp& help = info.flag_help;
  help.threads = "Torch intra-op threads (0 = all cores)";
  help.metrics_port = "Prometheus /metrics port (0 = pick one); default: router.metrics_port";
  help.metrics_address = "Interface the metrics endpoint binds";
  help.tls_ca =
      "mutual TLS of the RouterService port and of the calls to the groups: PEM of the CA "
      "that signs every peer (with --tls_cert, --tls_key; all empty = the cluster file's "
      "tls, or plaintext)";
  help.port_file = "If set, write '<grpc port> <metrics port>' here once serving";
  help.max_message_bytes = "Max gRPC message size, both directions";
  return info;
}

absl::StatusOr<RouterServerOptions> OptionsFromCluster(const v1::ClusterConfig& cluster) {
  RouterServerOptions o;
  HIMOE_ASSIGN_OR_RETURN(o.moe.routing, model::RoutingConfigFromCluster(cluster));
  o.moe.shape = ExpertShapeFromCluster(cluster);
  o.moe.wire_dtype = cluster.router().wire_dtype() == "bfloat16" ? c10::kBFloat16 : c10::kFloat;
  o.moe.chunk_bytes = cluster.router().chunk_bytes();
  o.moe.shared_memory = cluster.router().shared_memory();
  o.moe.reload_changed_experts = absl::GetFlag(FLAGS_reload_changed_experts);
  for (const auto& g : cluster.groups()) {
    expert::ExpertGroupClientOptions go;
    go.addresses.push_back(g.address());
    go.addresses.insert(go.addresses.end(), g.replicas().begin(), g.replicas().end());
    go.deadline = std::chrono::milliseconds(cluster.router().deadline_ms());
    go.keepalive = std::chrono::milliseconds(cluster.router().keepalive_ms());
    go.max_message_bytes = MaxMessageBytesFlag();
    go.tls = ClusterTls(cluster, GetServiceFlags().tls, ClusterRole::kRouter);
    o.moe.groups.push_back(go);
  }
  o.batching.max_batch_tokens = cluster.router().max_batch_tokens();
  o.batching.max_queue_delay = std::chrono::microseconds(cluster.router().max_queue_delay_us());
  o.batching.max_queue_requests = cluster.router().max_queue_requests();
  o.batching.queue_limit_name = "router.max_queue_requests";
  o.batching.max_batches_in_flight = cluster.router().max_batches_in_flight();
  o.max_tokens_per_request = cluster.router().max_tokens_per_request();
  o.max_message_bytes = MaxMessageBytesFlag();
  o.tls = ClusterTls(cluster, GetServiceFlags().tls, ClusterRole::kRouter);
  o.address = absl::GetFlag(FLAGS_address).empty() ? cluster.router().address()
                                                    : absl::GetFlag(FLAGS_address);
  if (o.address.empty()) o.address = "0.0.0.0:50050";
  HIMOE_RETURN_IF_ERROR(
      ParseHostPort(absl::GetFlag(FLAGS_address).empty() ? "router.address" : "--address",
                    o.address)
          .status());
  return o;
}

// Serving a checkpoint: its routers and routing settings replace the cluster
// file's, and Generate samples from its LM on the router's own MoE layers.
// The cluster's experts must have the model's shape (the seed and the init
// may differ when the checkpoint's expert weights are pushed to them).
absl::Status ServeCheckpoint(const v1::ClusterConfig& cluster,
                             std::shared_ptr<const model::CheckpointContents> contents,
                             RouterServerOptions* o) {
  v1::ExpertShape trained = model::ExpertShapeFor(contents->model);
  const v1::ExpertShape served = ExpertShapeFromCluster(cluster);
  if (absl::GetFlag(FLAGS_load_expert_state)) {
    trained.set_seed(served.seed());
    trained.set_init(served.init());
    trained.set_n_layer(served.n_layer());
  }
  HIMOE_RETURN_IF_ERROR(CheckExpertShape(
      trained, served,
      absl::StrCat("--cluster ", absl::GetFlag(FLAGS_cluster), " (model section)")));
  o->moe.routing = contents->model.routing;
  model::GeneratorOptions go;
  go.max_new_tokens_limit = absl::GetFlag(FLAGS_max_new_tokens);
  go.max_streams = absl::GetFlag(FLAGS_max_streams);
  go.kv_cache = absl::GetFlag(FLAGS_kv_cache);
  go.load_expert_state = absl::GetFlag(FLAGS_load_expert_state);
  o->make_generator = [contents, go](model::MoELayers& moe)
      -> absl::StatusOr<std::shared_ptr<model::TextGenerator>> {
    HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<model::Generator> generator,
                           model::Generator::Create(*contents, &moe, go));
    LOG(INFO) << "Generate: serving " << contents->dir << " (step " << contents->step
              << ", vocab " << generator->vocab_size() << ")";
    return std::shared_ptr<model::TextGenerator>(std::move(generator));
  };
  return absl::OkStatus();
}

absl::Status Run(StartupTimer& startup) {
  HIMOE_RETURN_IF_ERROR(ConfigureServiceCompute());
  startup.Mark("compute set-up");
  if (absl::GetFlag(FLAGS_cluster).empty()) {
    return absl::InvalidArgumentError("--cluster is required (see --help)");
  }
  HIMOE_ASSIGN_OR_RETURN(const v1::ClusterConfig cluster,
                         LoadClusterConfig(absl::GetFlag(FLAGS_cluster)));
  HIMOE_ASSIGN_OR_RETURN(RouterServerOptions o, OptionsFromCluster(cluster));
  if (const std::string checkpoint = absl::GetFlag(FLAGS_checkpoint); !checkpoint.empty()) {
    HIMOE_ASSIGN_OR_RETURN(model::CheckpointContents contents, model::ReadCheckpoint(checkpoint));
    HIMOE_RETURN_IF_ERROR(ServeCheckpoint(
        cluster, std::make_shared<const model::CheckpointContents>(std::move(contents)), &o));
    // The model served is the checkpoint's, pushed or already in the groups.
    o.moe.pin_weights = true;
    startup.Mark("checkpoint read");
  }

  const int metrics_flag = GetServiceFlags().metrics_port;
  const int metrics_port = metrics_flag >= 0 ? metrics_flag : cluster.router().metrics_port();
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<prometheus::Exposer> exposer,
                         StartServiceMetrics(metrics_port));
  if (exposer == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "router.metrics_port: ", metrics_port, " is not a port (0-65535; 0 picks one)"));
  }
  auto registry = std::make_shared<prometheus::Registry>();
  exposer->RegisterCollectable(registry);
  o.registry = registry.get();

  startup.Mark("metrics");
  // Includes asking every group for its Info and, with --checkpoint, pushing
  // the expert weights to the groups.
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<RouterServer> server, RouterServer::Start(o));
  startup.Mark("groups and server");
  LOG(INFO) << "himoe-router serving on port " << server->port() << " (metrics on "
            << MetricsPort(*exposer) << "), " << RoutingConfigDebugString(o.moe.routing);
  HIMOE_RETURN_IF_ERROR(WritePortFile(server->port(), exposer.get()));
  LOG(INFO) << startup.Summary();
  WaitUntilStopSignal();
  LOG(INFO) << "himoe-router shutting down";
  server->Shutdown();
  return absl::OkStatus();
}

}  // namespace
}  // namespace himoe::router

int main(int argc, char** argv) {
  himoe::StartupTimer startup;
  const himoe::ServiceInfo info = himoe::router::Info();
  himoe::InitService(argc, argv, info);
  return himoe::ServiceExitCode(info, himoe::router::Run(startup));
}
