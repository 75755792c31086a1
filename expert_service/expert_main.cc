// himoe-expert: serves one expert group (for every MoE layer) over gRPC.

#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "expert_service/expert_grpc_service.h"
#include "expert_service/expert_metrics.h"
#include "glog/logging.h"
#include "prometheus/exposer.h"

ABSL_FLAG(std::string, address, "0.0.0.0", "IP address to listen on");
ABSL_FLAG(int32_t, port, 50051, "port to listen on; 0 picks a free one");
ABSL_FLAG(int32_t, group_id, 0, "the expert group served, in [0, num_groups)");
ABSL_FLAG(int32_t, num_groups, 1, "M: expert groups of the model");
ABSL_FLAG(int32_t, num_experts, 8, "N: experts per MoE layer, a multiple of M");
ABSL_FLAG(int32_t, num_layers, 1, "MoE layers of the model (all are served)");
ABSL_FLAG(int64_t, d_model, 64, "model width");
ABSL_FLAG(int64_t, d_ff, 256, "expert hidden width");
ABSL_FLAG(uint64_t, seed, 0, "weight seed; must equal the router's");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda:K");
ABSL_FLAG(std::string, dtype, "float32", "expert weights: float32 or bfloat16");
ABSL_FLAG(int32_t, metrics_port, -1,
          "Prometheus /metrics port; 0 picks a free one, -1 disables metrics");
ABSL_FLAG(std::string, metrics_address, "0.0.0.0", "interface of the metrics endpoint");
ABSL_FLAG(int32_t, threads, 0, "torch intra-op threads; 0 = all cores");
ABSL_FLAG(int32_t, max_message_bytes, 64 << 20, "max gRPC message, both ways");
ABSL_FLAG(int64_t, max_tokens, 65536, "max rows in one Forward request");
ABSL_FLAG(double, saved_state_ttl_s, 300,
          "seconds a Forward saved for Backward is kept before it is dropped");
ABSL_FLAG(std::string, state_file, "",
          "optional length-delimited StateChunk stream to load before serving");
ABSL_FLAG(std::string, port_file, "",
          "if set, write \"<grpc port>[ <metrics port>]\" here once serving");

namespace himoe::expert {
namespace {

std::atomic<bool> g_stop{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void OnStopSignal(int) { g_stop.store(true); }

absl::Status InstallSignalHandlers() {
  struct sigaction action = {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  for (const int sig : {SIGTERM, SIGINT}) {
    if (sigaction(sig, &action, nullptr) != 0) {
      return absl::InternalError(absl::StrCat("sigaction(", sig, ") failed"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<c10::ScalarType> ParseDtype(const std::string& name) {
  if (name == "float32") return c10::kFloat;
  if (name == "bfloat16") return c10::kBFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("--dtype: expected float32 or bfloat16, got '", name, "'"));
}

// Written under a temporary name and renamed, so readers never see a partial file.
absl::Status WritePortFile(const std::string& path, const std::string& ports) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << ports << "\n";
    out.close();
    if (!out) return absl::UnavailableError(absl::StrCat("cannot write '", tmp, "'"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename '", tmp, "' to '", path, "'"));
  }
  return absl::OkStatus();
}

absl::Status Run() {
  RETURN_IF_ERROR(ConfigureTorchThreads(absl::GetFlag(FLAGS_threads)));
  ExpertServerOptions options;
  ExpertServiceOptions& core = options.core;
  core.group_id = absl::GetFlag(FLAGS_group_id);
  core.num_groups = absl::GetFlag(FLAGS_num_groups);
  core.num_experts = absl::GetFlag(FLAGS_num_experts);
  core.num_layers = absl::GetFlag(FLAGS_num_layers);
  core.d_model = absl::GetFlag(FLAGS_d_model);
  core.d_ff = absl::GetFlag(FLAGS_d_ff);
  core.seed = absl::GetFlag(FLAGS_seed);
  ASSIGN_OR_RETURN(core.device, ParseDevice(absl::GetFlag(FLAGS_device)));
  ASSIGN_OR_RETURN(core.dtype, ParseDtype(absl::GetFlag(FLAGS_dtype)));
  core.max_tokens_per_request = absl::GetFlag(FLAGS_max_tokens);
  if (const double ttl = absl::GetFlag(FLAGS_saved_state_ttl_s); ttl >= 0) {
    core.saved_state_ttl = absl::Seconds(ttl);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--saved_state_ttl_s: ", ttl, "; expected >= 0"));
  }
  const int port = absl::GetFlag(FLAGS_port);
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--port: ", port, " is out of range"));
  }
  std::string host = absl::GetFlag(FLAGS_address);
  if (host.find(':') != std::string::npos && host.front() != '[') {
    host = absl::StrCat("[", host, "]");  // IPv6 literal
  }
  options.address = absl::StrCat(host, ":", port);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.state_file = absl::GetFlag(FLAGS_state_file);

  RETURN_IF_ERROR(InstallSignalHandlers());
  ASSIGN_OR_RETURN(std::unique_ptr<ExpertServer> server, ExpertServer::Start(options));
  const ExpertServiceInfo info = server->core()->Info();
  LOG(INFO) << info.version << ": group " << info.group_id << " of "
            << info.num_groups << ", experts [" << absl::StrJoin(info.expert_ids, ",")
            << "], " << info.layers.size() << " layers, d_model " << info.d_model
            << ", d_ff " << info.d_ff << ", " << c10::toString(info.dtype) << " on "
            << info.device << (options.state_file.empty() ? "" : ", state from ")
            << options.state_file << "; serving on " << server->address();
  // Metrics: a scrape reads the core's counters; civetweb threads run beside torch's.
  std::unique_ptr<prometheus::Exposer> exposer;
  std::shared_ptr<ExpertMetrics> metrics;
  std::string ports = std::to_string(server->port());
  if (const int metrics_port = absl::GetFlag(FLAGS_metrics_port); metrics_port >= 0) {
    try {
      exposer = std::make_unique<prometheus::Exposer>(
          absl::StrCat(absl::GetFlag(FLAGS_metrics_address), ":", metrics_port));
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("--metrics_port ", metrics_port, ": cannot listen: ", e.what()));
    }
    metrics = std::make_shared<ExpertMetrics>(server->core());
    exposer->RegisterCollectable(metrics);
    absl::StrAppend(&ports, " ", exposer->GetListeningPorts().front());
    LOG(INFO) << "metrics on port " << exposer->GetListeningPorts().front();
  }
  if (const std::string port_file = absl::GetFlag(FLAGS_port_file); !port_file.empty()) {
    RETURN_IF_ERROR(WritePortFile(port_file, ports));
  }

  std::atomic<bool> stopped{false};
  std::thread watcher([&] {
    while (!g_stop.load() && !stopped.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (g_stop.load()) {
      LOG(INFO) << "stop signal received; shutting down";
      server->Shutdown(absl::Seconds(10));
    }
  });
  server->Wait();
  stopped.store(true);
  watcher.join();
  LOG(INFO) << "himoe-expert stopped";
  return absl::OkStatus();
}

}  // namespace
}  // namespace himoe::expert

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (std::getenv("GLOG_logtostderr") == nullptr && std::getenv("GLOG_log_dir") == nullptr) {
    FLAGS_logtostderr = true;
  }
  google::InitGoogleLogging(argv[0]);
  const absl::Status status = himoe::expert::Run();
  if (!status.ok()) {
    LOG(ERROR) << "himoe-expert: " << status;
    return 1;
  }
  return 0;
}
