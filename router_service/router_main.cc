// himoe-router: grouped top-K routing in front of the expert-group services.
#include <atomic>
#include <chrono>
#include <csignal>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include <glog/logging.h>
#include <prometheus/exposer.h>
#include <prometheus/registry.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cluster_config.h"
#include "common/torch_runtime.h"
#include "router_service/router_grpc_service.h"
#include "trainer/generator.h"

ABSL_FLAG(std::string, cluster, "", "Cluster file (protobuf text format; see deploy/local)");
ABSL_FLAG(std::string, address, "",
          "host:port to listen on; default: router.address of the cluster file");
ABSL_FLAG(int, metrics_port, -1,
          "Prometheus /metrics port (0 = pick one); default: router.metrics_port");
ABSL_FLAG(std::string, metrics_address, "0.0.0.0", "Interface the metrics endpoint binds");
ABSL_FLAG(int, threads, 0, "Torch intra-op threads (0 = all cores)");
ABSL_FLAG(std::string, port_file, "",
          "If set, write '<grpc port> <metrics port>' here once serving");
ABSL_FLAG(int, max_message_bytes, 64 << 20, "Max gRPC message size, both directions");
ABSL_FLAG(std::string, checkpoint, "",
          "Serve Generate from this trainer checkpoint (a step_* directory, or the "
          "checkpoints root: its newest); empty = no Generate");
ABSL_FLAG(bool, load_expert_state, true,
          "With --checkpoint: push the checkpoint's expert weights to the groups at start");
ABSL_FLAG(int, max_new_tokens, 4096, "Most tokens one Generate request may ask for");

namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

int Fail(const absl::Status& status) {
  LOG(ERROR) << status;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  using namespace himoe;
  if (auto s = ConfigureTorchThreads(absl::GetFlag(FLAGS_threads)); !s.ok()) return Fail(s);
  if (absl::GetFlag(FLAGS_cluster).empty()) {
    return Fail(absl::InvalidArgumentError("--cluster is required"));
  }
  auto cluster = LoadClusterConfig(absl::GetFlag(FLAGS_cluster));
  if (!cluster.ok()) return Fail(cluster.status());
  auto routing = router::RoutingConfigFromCluster(*cluster);
  if (!routing.ok()) return Fail(routing.status());

  router::RouterServerOptions o;
  o.moe.routing = *routing;
  o.moe.d_model = cluster->model().d_model();
  o.moe.num_layers = cluster->model().num_layers();
  o.moe.seed = cluster->model().seed();
  o.moe.wire_dtype = cluster->router().wire_dtype() == "bfloat16" ? c10::kBFloat16 : c10::kFloat;
  o.moe.chunk_bytes = cluster->router().chunk_bytes();
  for (const auto& g : cluster->groups()) {
    router::GroupClientOptions go;
    go.addresses.push_back(g.address());
    go.addresses.insert(go.addresses.end(), g.replicas().begin(), g.replicas().end());
    go.deadline = std::chrono::milliseconds(cluster->router().deadline_ms());
    go.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
    o.moe.groups.push_back(go);
  }
  o.batching.max_batch_tokens = cluster->router().max_batch_tokens();
  o.batching.max_queue_delay = std::chrono::microseconds(cluster->router().max_queue_delay_us());
  o.max_tokens_per_request = cluster->router().max_tokens_per_request();
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  o.address = absl::GetFlag(FLAGS_address).empty() ? cluster->router().address()
                                                    : absl::GetFlag(FLAGS_address);
  if (o.address.empty()) o.address = "0.0.0.0:50050";

  const int metrics_port = absl::GetFlag(FLAGS_metrics_port) >= 0
                               ? absl::GetFlag(FLAGS_metrics_port)
                               : cluster->router().metrics_port();
  auto registry = std::make_shared<prometheus::Registry>();
  std::unique_ptr<prometheus::Exposer> exposer;
  int bound_metrics_port = 0;
  try {
    exposer = std::make_unique<prometheus::Exposer>(
        absl::StrCat(absl::GetFlag(FLAGS_metrics_address), ":", metrics_port));
  } catch (const std::exception& e) {
    return Fail(absl::UnavailableError(
        absl::StrCat("cannot open the metrics port ", metrics_port, ": ", e.what())));
  }
  exposer->RegisterCollectable(registry);
  bound_metrics_port = exposer->GetListeningPorts().front();
  o.registry = registry.get();

  std::shared_ptr<trainer::Generator> generator;
  if (const std::string checkpoint = absl::GetFlag(FLAGS_checkpoint); !checkpoint.empty()) {
    trainer::GeneratorOptions go;
    go.checkpoint = checkpoint;
    for (const auto& g : cluster->groups()) go.expert_addresses.push_back(g.address());
    go.load_expert_state = absl::GetFlag(FLAGS_load_expert_state);
    go.max_new_tokens_limit = absl::GetFlag(FLAGS_max_new_tokens);
    go.deadline = std::chrono::milliseconds(cluster->router().deadline_ms());
    auto created = trainer::Generator::Create(go);
    if (!created.ok()) return Fail(created.status());
    generator = std::move(created).value();
    LOG(INFO) << "Generate: serving " << generator->checkpoint_dir() << " (step "
              << generator->checkpoint_step() << ", vocab " << generator->vocab_size() << ")";
    // RouteForward routes as the trained model does.
    o.moe.routing = generator->model_options().routing;
    o.generator = generator;
  }

  auto server = router::RouterServer::Start(o);
  if (!server.ok()) return Fail(server.status());
  if (generator != nullptr) {
    if (auto s = generator->CopyRoutersTo((*server)->moe()); !s.ok()) return Fail(s);
  }
  LOG(INFO) << "himoe-router serving on port " << (*server)->port() << " (metrics on "
            << bound_metrics_port << "), " << router::RoutingConfigDebugString(o.moe.routing);
  if (const std::string f = absl::GetFlag(FLAGS_port_file); !f.empty()) {
    std::ofstream(f + ".tmp") << (*server)->port() << " " << bound_metrics_port << "\n";
    std::rename((f + ".tmp").c_str(), f.c_str());
  }
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (!g_stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  LOG(INFO) << "himoe-router shutting down";
  (*server)->Shutdown();
  return 0;
}
