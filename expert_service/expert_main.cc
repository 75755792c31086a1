// himoe-expert: serves one expert group (for every MoE layer) over gRPC.

#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/expert_shape.h"
#include "common/host_port.h"
#include "common/metrics_endpoint.h"
#include "common/process_stats.h"
#include "common/service_main.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "expert_service/expert_access.h"
#include "expert_service/expert_grpc_service.h"
#include "expert_service/expert_metrics.h"
#include "glog/logging.h"
#include "prometheus/exposer.h"

ABSL_FLAG(std::string, address, "0.0.0.0:50051",
          "host:port to listen on ([v6 host]:port for IPv6); port 0 picks a free one");
ABSL_FLAG(int32_t, group_id, 0, "the expert group served, in [0, num_groups)");
ABSL_FLAG(int32_t, num_groups, 1, "M: expert groups of the model");
ABSL_FLAG(int32_t, num_experts, 8, "N: experts per MoE layer, a multiple of M");
ABSL_FLAG(int32_t, num_layers, 1, "MoE layers of the model (all are served)");
ABSL_FLAG(int64_t, d_model, 64, "model width");
ABSL_FLAG(int64_t, d_ff, 256, "expert hidden width");
ABSL_FLAG(uint64_t, seed, 0, "weight seed; must equal the router's");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda:K");
ABSL_FLAG(std::string, dtype, "float32", "expert weights: float32 or bfloat16");
ABSL_FLAG(std::string, matmul_dtype, "float32",
          "float32 experts' products: float32, or bfloat16 (operands rounded to bfloat16, "
          "sums in float32; twice the GEMM rate on CPUs with AVX512_BF16); must match the "
          "trainer's --matmul_dtype");
ABSL_FLAG(std::string, init, "default",
          "fresh weights: default (nn.Linear's uniform) or switch (the released code's "
          "truncated normal; needs --n_layer)");
ABSL_FLAG(int32_t, n_layer, 0, "the transformer's depth: W2's init std under --init=switch");
ABSL_FLAG(int32_t, compute_workers, 1,
          "calls computed at once (Forward, Backward, Step), each on the --threads torch "
          "threads; off gRPC's threads");
ABSL_FLAG(int32_t, max_queue, 256,
          "calls that may wait for a compute worker; more get RESOURCE_EXHAUSTED at once");
ABSL_FLAG(int64_t, max_tokens, 65536, "max rows in one Forward request");
ABSL_FLAG(bool, defer_weight_grads, true,
          "answer Backward with the rows' gradient, then compute the weight gradients "
          "(before the next Backward or Step); false: inside Backward");
ABSL_FLAG(bool, shared_memory, false,
          "take rows in, and write outputs to, POSIX shared memory that a client on this "
          "host names (trusted clients only; himoe-trainer --experts=local turns it on for the "
          "groups it starts)");
ABSL_FLAG(double, saved_state_ttl_s, 300,
          "seconds a Forward saved for Backward is kept before it is dropped");
ABSL_FLAG(std::string, trainer_identity, "",
          "mutual TLS: a principal (URI or DNS subjectAltName) of the trainer's certificate; "
          "only it may call the training methods (BeginRun, Backward, Step, Abort, GetState, "
          "SetState, Forward with save_for_backward)");
ABSL_FLAG(std::string, router_identity, "",
          "mutual TLS, with --trainer_identity: a principal of the router's certificate; it may "
          "call Info, Forward and SetState (loading the model it serves)");
ABSL_FLAG(std::string, authz_policy, "",
          "a gRPC authorization policy (JSON: name, allow_rules, deny_rules; principals are "
          "certificate SANs, paths /himoe.v1.ExpertService/<method>), instead of the roles");
ABSL_FLAG(bool, insecure_training, false,
          "plaintext on a non-loopback --address: answer the training methods anyway (anyone "
          "who reaches the port may then train or replace the weights)");
ABSL_FLAG(std::string, state_file, "",
          "optional length-delimited StateChunk stream to load before serving");
ABSL_FLAG(std::string, run_state_file, "",
          "keep the training run here: rewritten (atomically, off the request path) after "
          "every applied Step with the run id, step, weights and AdamW state; a group "
          "restarted on it serves the run again from that step, and the trainer runs the "
          "failed step again instead of reloading a checkpoint");

namespace himoe::expert {
namespace {

ServiceInfo Info() {
  ServiceInfo info;
  info.name = "himoe-expert";
  info.usage =
      "Serves one expert group of a Hi-MoE model over gRPC.\n"
      "  himoe-expert --address=0.0.0.0:50051 --group_id=0 --num_groups=4 --num_experts=8 "
      "--num_layers=2 --d_model=64 --d_ff=256 --seed=0 [--dtype=bfloat16] [--metrics_port=0]";
  return info;  // the shared flags keep their shared help
}

absl::StatusOr<v1::ExpertShape> ShapeFromFlags() {
  ExpertShapeFlags flags;
  flags.num_experts = absl::GetFlag(FLAGS_num_experts);
  flags.num_groups = absl::GetFlag(FLAGS_num_groups);
  flags.num_layers = absl::GetFlag(FLAGS_num_layers);
  flags.d_model = absl::GetFlag(FLAGS_d_model);
  flags.d_ff = absl::GetFlag(FLAGS_d_ff);
  flags.seed = absl::GetFlag(FLAGS_seed);
  flags.dtype = absl::GetFlag(FLAGS_dtype);
  flags.matmul_dtype = absl::GetFlag(FLAGS_matmul_dtype);
  flags.init = absl::GetFlag(FLAGS_init);
  flags.n_layer = absl::GetFlag(FLAGS_n_layer);
  return ExpertShapeFromFlags(flags);
}

absl::StatusOr<ExpertServerOptions> OptionsFromFlags() {
  ExpertServerOptions options;
  ExpertServiceOptions& core = options.core;
  HIMOE_ASSIGN_OR_RETURN(core.shape, ShapeFromFlags());
  core.group_id = absl::GetFlag(FLAGS_group_id);
  HIMOE_ASSIGN_OR_RETURN(core.device, ParseDevice(absl::GetFlag(FLAGS_device)));
  core.max_tokens_per_request = absl::GetFlag(FLAGS_max_tokens);
  core.defer_weight_grads = absl::GetFlag(FLAGS_defer_weight_grads);
  core.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  if (const double ttl = absl::GetFlag(FLAGS_saved_state_ttl_s); ttl >= 0) {
    core.saved_state_ttl = absl::Seconds(ttl);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--saved_state_ttl_s: ", ttl, "; expected >= 0"));
  }
  HIMOE_ASSIGN_OR_RETURN(const HostPort listen,
                         ParseHostPort("--address", absl::GetFlag(FLAGS_address)));
  options.address = JoinHostPort(listen.host, listen.port);
  options.max_message_bytes = MaxMessageBytesFlag();
  options.compute = ComputePoolOptions{absl::GetFlag(FLAGS_compute_workers),
                                       absl::GetFlag(FLAGS_max_queue), "--max_queue"};
  options.state_file = absl::GetFlag(FLAGS_state_file);
  options.run_state_file = absl::GetFlag(FLAGS_run_state_file);
  options.tls = GetServiceFlags().tls;
  ExpertAccessOptions access;
  access.policy_file = absl::GetFlag(FLAGS_authz_policy);
  access.trainer_identity = absl::GetFlag(FLAGS_trainer_identity);
  access.router_identity = absl::GetFlag(FLAGS_router_identity);
  access.tls = options.tls.enabled();
  access.loopback = IsLoopbackHost(listen.host);
  access.insecure_training = absl::GetFlag(FLAGS_insecure_training);
  std::vector<std::string> warnings;
  HIMOE_ASSIGN_OR_RETURN(options.policy, ExpertAccessPolicy(access, &warnings));
  for (const std::string& w : warnings) LOG(WARNING) << w;
  if (options.policy != nullptr) {
    LOG(INFO) << "authorization policy '" << options.policy->name() << "'";
  }
  return options;
}

// Metrics: a scrape reads the core's counters; civetweb threads run beside
// torch's. Null when --metrics_port is negative.
absl::StatusOr<std::unique_ptr<prometheus::Exposer>> StartMetrics(
    ExpertServer* server, std::shared_ptr<ExpertMetrics>* metrics) {
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<prometheus::Exposer> exposer,
                         StartServiceMetrics(GetServiceFlags().metrics_port));
  if (exposer == nullptr) return nullptr;
  *metrics = std::make_shared<ExpertMetrics>(server->core(), &server->compute_pool());
  exposer->RegisterCollectable(*metrics);
  LOG(INFO) << "metrics on port " << MetricsPort(*exposer);
  return exposer;
}

void LogServing(ExpertServer& server, const ExpertServerOptions& options) {
  const ExpertServiceInfo info = server.core()->Info();
  LOG(INFO) << info.version << ": group " << info.group_id << " of "
            << info.shape.num_groups() << ", experts [" << absl::StrJoin(info.expert_ids, ",")
            << "], " << ExpertShapeDebugString(info.shape) << " on " << info.device
            << (options.state_file.empty() ? "" : ", state from ") << options.state_file
            << "; serving on " << server.address();
  if (const std::optional<uint64_t> step = server.restored_step(); step.has_value()) {
    LOG(INFO) << "run '" << info.run_id << "' restored at step " << *step << " from "
              << options.run_state_file;
  }
}

absl::Status Run(StartupTimer& startup) {
  HIMOE_RETURN_IF_ERROR(ConfigureServiceCompute());
  startup.Mark("compute set-up");
  HIMOE_ASSIGN_OR_RETURN(const ExpertServerOptions options, OptionsFromFlags());
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<ExpertServer> server, ExpertServer::Start(options));
  startup.Mark("experts and server");
  LogServing(*server, options);
  std::shared_ptr<ExpertMetrics> metrics;
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<prometheus::Exposer> exposer,
                         StartMetrics(server.get(), &metrics));
  HIMOE_RETURN_IF_ERROR(WritePortFile(server->port(), exposer.get()));
  startup.Mark("metrics");
  LOG(INFO) << startup.Summary();

  const int sig = WaitUntilStopSignal();
  LOG(INFO) << "stop signal " << sig << " received; shutting down";
  server->Shutdown(absl::Seconds(10));
  server->Wait();
  LOG(INFO) << "himoe-expert stopped";
  return absl::OkStatus();
}

}  // namespace
}  // namespace himoe::expert

int main(int argc, char** argv) {
  himoe::StartupTimer startup;
  const himoe::ServiceInfo info = himoe::expert::Info();
  himoe::InitService(argc, argv, info);
  return himoe::ServiceExitCode(info, himoe::expert::Run(startup));
}
