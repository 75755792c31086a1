// himoe-bench: MoE-layer forward throughput, in-process vs over gRPC.
//
//   local        LocalMoE in this process (eval, no grad), --threads torch threads
//   remote_fp32  RemoteMoE (the router's dispatch path) -> M himoe-expert
//                processes on 127.0.0.1, rows and outputs as float32 on the wire
//   remote_bf16  the same with bfloat16 on the wire
//   remote_shm   remote_fp32 with the rows and outputs in POSIX shared memory
//                (RemoteMoEOptions.shared_memory; the processes run with
//                --shared_memory), gRPC carrying only where
//
// Same seed (so the same gate and expert weights) and the same input for all.
// Before timing, remote_fp32 must match local within 1e-4 (max abs) and
// remote_bf16 within 2e-2 relative (the README's bf16 tolerance). The expert
// processes are a LocalExpertCluster (deploy/local): stopped on return, and,
// through PR_SET_PDEATHSIG, when this process exits or is killed.
//
// Threads (a fair default on any core count C): the local run uses C torch
// threads; in the remote runs this process (routing, encode, combine) keeps
// --threads = C and each of the M expert processes gets
// --expert_threads = max(1, C / M), so the experts together use about C
// threads. All M groups are busy at once (himoe gives each token one expert
// in every group), so with C < M the experts oversubscribe the cores.
//
// Columns: Time is wall time per forward; CPU is this process's CPU time
// (all its threads); tokens is tokens/s of wall time; expert_cpu_s is the CPU
// seconds all expert processes spent per forward.
//
// Example (Release build):
//   himoe-bench --benchmark_min_time=3 --benchmark_repetitions=5
//     --benchmark_enable_random_interleaving --fp32_chunk_sweep=256K,4M,16M
// The summary ratios use the median tokens/s over the repetitions.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/compute_setup.h"
#include "common/process_stats.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "deploy/local/local_cluster.h"
#include "router_service/remote_moe.h"
#include "router_service/routing/local_moe.h"

ABSL_FLAG(bool, blas_probe, true, "probe BLIS kernel sets (see himoe-trainer --help)");
ABSL_FLAG(int64_t, tokens, 4096, "tokens per forward (T)");
ABSL_FLAG(int64_t, d_model, 512, "model width");
ABSL_FLAG(int64_t, d_ff, 2048, "expert hidden width");
ABSL_FLAG(int32_t, num_experts, 8, "N");
ABSL_FLAG(int32_t, num_groups, 4, "M: expert groups = expert processes");
ABSL_FLAG(int32_t, top_k, 1, "k per group (himoe)");
ABSL_FLAG(uint64_t, seed, 1234, "weight seed (gate and experts) and input seed");
ABSL_FLAG(int32_t, threads, 0,
          "torch intra-op threads of this process (local MoE; routing and "
          "combine in the remote runs); 0 = all cores");
ABSL_FLAG(int32_t, expert_threads, 0,
          "--threads of each himoe-expert process; 0 = max(1, cores / num_groups)");
ABSL_FLAG(std::string, chunk_bytes, "4M",
          "RemoteMoE chunk_bytes for remote_fp32/remote_bf16 (suffix K or M allowed)");
ABSL_FLAG(std::string, fp32_chunk_sweep, "",
          "comma-separated extra chunk_bytes values for remote_fp32, e.g. 256K,1M,4M,16M");
ABSL_FLAG(std::string, expert_bin, HIMOE_EXPERT_BIN, "path of himoe-expert");
ABSL_FLAG(int32_t, startup_timeout_s, 120, "how long to wait for the experts to serve");
ABSL_FLAG(int32_t, deadline_ms, 120000, "per Forward call to an expert group");

namespace himoe::bench {
namespace {

using router::LocalMoE;
using router::MoEOutput;
using router::RemoteMoE;

// The expert processes (LocalExpertCluster: stopped with it, and through
// PR_SET_PDEATHSIG when this process dies).

// User + system CPU seconds the expert processes have used so far.
double ExpertCpuSeconds(const local::LocalExpertCluster& cluster) {
  double seconds = 0;
  for (const int pid : cluster.pids()) seconds += CpuSeconds(pid).value_or(0.0);
  return seconds;
}

// ---------------------------------------------------------------------------

absl::StatusOr<int64_t> ParseBytes(absl::string_view text) {
  int64_t scale = 1;
  if (!text.empty() && (text.back() == 'K' || text.back() == 'k')) scale = 1 << 10;
  if (!text.empty() && (text.back() == 'M' || text.back() == 'm')) scale = 1 << 20;
  if (scale != 1) text.remove_suffix(1);
  int64_t value = 0;
  if (!absl::SimpleAtoi(text, &value) || value < 1) {
    return absl::InvalidArgumentError(absl::StrCat("bad byte count '", text, "'"));
  }
  return value * scale;
}

std::string BytesName(int64_t bytes) {
  if (bytes % (1 << 20) == 0) return absl::StrCat(bytes >> 20, "MiB");
  if (bytes % (1 << 10) == 0) return absl::StrCat(bytes >> 10, "KiB");
  return absl::StrCat(bytes, "B");
}

using ForwardFn = std::function<absl::StatusOr<MoEOutput>()>;

// `cluster` is null for the in-process run.
void RunForwards(benchmark::State& state, const ForwardFn& forward, int64_t tokens,
                 const local::LocalExpertCluster* cluster) {
  at::NoGradGuard no_grad;
  const double expert_cpu_start = cluster != nullptr ? ExpertCpuSeconds(*cluster) : 0.0;
  for (auto _ : state) {
    absl::StatusOr<MoEOutput> out = forward();
    if (!out.ok()) {
      state.SkipWithError(std::string(out.status().message()).c_str());
      break;
    }
    benchmark::DoNotOptimize(out->output.data_ptr());
  }
  state.counters["tokens"] = benchmark::Counter(static_cast<double>(tokens),
                                                benchmark::Counter::kIsIterationInvariantRate);
  if (cluster != nullptr) {
    // CPU seconds the expert processes spent per forward (the CPU column is
    // this process only).
    state.counters["expert_cpu_s"] = benchmark::Counter(
        ExpertCpuSeconds(*cluster) - expert_cpu_start, benchmark::Counter::kAvgIterations);
  }
}

// Keeps the console output and remembers tokens/s of each benchmark by name
// (the median over --benchmark_repetitions: robust on a shared machine).
class CapturingReporter : public benchmark::ConsoleReporter {
 public:
  CapturingReporter()
      : ConsoleReporter(isatty(STDOUT_FILENO) ? OO_ColorTabular : OO_Tabular) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& run : runs) {
      if (run.error_occurred || run.run_type != Run::RT_Iteration) continue;
      const auto it = run.counters.find("tokens");
      if (it != run.counters.end()) rates_[run.run_name.function_name].push_back(it->second.value);
    }
    ConsoleReporter::ReportRuns(runs);
  }
  double rate(const std::string& name) const {
    const auto it = rates_.find(name);
    if (it == rates_.end() || it->second.empty()) return 0.0;
    std::vector<double> v = it->second;
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  }

 private:
  std::map<std::string, std::vector<double>> rates_;
};

absl::Status Run() {
  HIMOE_RETURN_IF_ERROR(
      ConfigureServingCompute(absl::GetFlag(FLAGS_threads), absl::GetFlag(FLAGS_blas_probe)));
  const int cores = DefaultThreadCount();
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  const int64_t d = absl::GetFlag(FLAGS_d_model);
  const int64_t d_ff = absl::GetFlag(FLAGS_d_ff);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const int groups = absl::GetFlag(FLAGS_num_groups);
  int expert_threads = absl::GetFlag(FLAGS_expert_threads);
  if (expert_threads <= 0) expert_threads = std::max(1, cores / groups);
  HIMOE_ASSIGN_OR_RETURN(const int64_t chunk_bytes, ParseBytes(absl::GetFlag(FLAGS_chunk_bytes)));
  std::vector<int64_t> sweep;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_fp32_chunk_sweep), ',',
                                            absl::SkipEmpty())) {
    HIMOE_ASSIGN_OR_RETURN(const int64_t b, ParseBytes(s));
    if (b != chunk_bytes) sweep.push_back(b);
  }

  router::RoutingConfig routing;
  routing.method = router::RoutingMethod::kHiMoe;
  routing.num_experts = absl::GetFlag(FLAGS_num_experts);
  routing.num_groups = groups;
  routing.top_k = absl::GetFlag(FLAGS_top_k);
  HIMOE_RETURN_IF_ERROR(router::ApplyPreset("paper", &routing));
  HIMOE_RETURN_IF_ERROR(router::ValidateRoutingConfig(routing));

  std::printf("himoe-bench: T=%ld d_model=%ld d_ff=%ld N=%d M=%d k=%d himoe eval; cores=%d, "
              "bench threads=%d, %d expert processes x %d threads, chunk_bytes=%s\n",
              static_cast<long>(tokens), static_cast<long>(d), static_cast<long>(d_ff),
              routing.num_experts, groups, routing.top_k, cores, at::get_num_threads(), groups,
              expert_threads, BytesName(chunk_bytes).c_str());

  router::LocalMoEOptions lo;
  v1::ExpertShape shape;
  shape.set_num_experts(routing.num_experts);
  shape.set_num_groups(routing.num_groups);
  shape.set_num_layers(1);
  shape.set_d_model(d);
  shape.set_d_ff(d_ff);
  shape.set_seed(seed);
  shape.set_dtype(v1::DTYPE_FLOAT32);

  local::ExpertProcessOptions eo;
  eo.binary = absl::GetFlag(FLAGS_expert_bin);
  eo.shape = shape;
  eo.threads = expert_threads;
  eo.ready_timeout = std::chrono::seconds(absl::GetFlag(FLAGS_startup_timeout_s));
  eo.shared_memory = true;
  eo.max_tokens = std::max<int64_t>(tokens, 65536);
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<local::LocalExpertCluster> cluster,
                         local::LocalExpertCluster::Start(eo));

  at::manual_seed(seed);
  const at::Tensor x = at::randn({tokens, d});

  lo.routing = routing;
  lo.shape = shape;
  lo.layer = 0;
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<LocalMoE> local, LocalMoE::Create(lo));

  auto make_remote = [&](c10::ScalarType wire, int64_t chunk, bool shared_memory = false)
      -> absl::StatusOr<std::unique_ptr<RemoteMoE>> {
    router::RemoteMoEOptions o;
    o.routing = routing;
    o.shape = shape;
    o.wire_dtype = wire;
    o.chunk_bytes = chunk;
    o.shared_memory = shared_memory;
    for (int g = 0; g < groups; ++g) {
      expert::ExpertGroupClientOptions go;
      go.addresses = {cluster->addresses()[g]};
      go.deadline = std::chrono::milliseconds(absl::GetFlag(FLAGS_deadline_ms));
      o.groups.push_back(go);
    }
    return RemoteMoE::Create(o);
  };
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<RemoteMoE> remote_fp32, make_remote(at::kFloat, chunk_bytes));
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<RemoteMoE> remote_bf16,
                   make_remote(at::kBFloat16, chunk_bytes));
  HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<RemoteMoE> remote_shm,
                         make_remote(at::kFloat, chunk_bytes, /*shared_memory=*/true));
  std::vector<std::unique_ptr<RemoteMoE>> swept;
  for (const int64_t b : sweep) {
    HIMOE_ASSIGN_OR_RETURN(std::unique_ptr<RemoteMoE> r, make_remote(at::kFloat, b));
    swept.push_back(std::move(r));
  }

  // Correctness once, before timing (this also warms every path up).
  {
    at::NoGradGuard no_grad;
    HIMOE_ASSIGN_OR_RETURN(const MoEOutput want, local->Forward(x, /*training=*/false));
    HIMOE_ASSIGN_OR_RETURN(const MoEOutput got32, remote_fp32->Forward(0, x));
    HIMOE_ASSIGN_OR_RETURN(const MoEOutput got16, remote_bf16->Forward(0, x));
    HIMOE_ASSIGN_OR_RETURN(const MoEOutput got_shm, remote_shm->Forward(0, x));
    const double err32 = (got32.output - want.output).abs().max().item<double>();
    const double err_shm = (got_shm.output - want.output).abs().max().item<double>();
    const double rel16 =
        ((got16.output - want.output).norm() / want.output.norm()).item<double>();
    std::printf("check: remote_fp32 max|diff| = %.3g (<= 1e-4), remote_bf16 relative = %.3g "
                "(< 2e-2)\n", err32, rel16);
    if (!(err32 <= 1e-4)) {
      return absl::InternalError(absl::StrCat("remote_fp32 differs from local by ", err32));
    }
    std::printf("check: remote_shm max|diff| = %.3g (<= 1e-4)\n", err_shm);
    if (!(err_shm <= 1e-4)) {
      return absl::InternalError(absl::StrCat("remote_shm differs from local by ", err_shm));
    }
    if (!(rel16 < 2e-2)) {
      return absl::InternalError(absl::StrCat("remote_bf16 relative error ", rel16));
    }
    for (size_t i = 0; i < swept.size(); ++i) {
      HIMOE_ASSIGN_OR_RETURN(const MoEOutput got, swept[i]->Forward(0, x));
      const double err = (got.output - want.output).abs().max().item<double>();
      if (!(err <= 1e-4)) {
        return absl::InternalError(absl::StrCat("remote_fp32 with chunk_bytes ", sweep[i],
                                                " differs from local by ", err));
      }
    }
  }

  const std::string local_name = absl::StrCat("local/threads:", at::get_num_threads());
  const std::string fp32_name = absl::StrCat("remote_fp32/chunk:", BytesName(chunk_bytes));
  const std::string bf16_name = absl::StrCat("remote_bf16/chunk:", BytesName(chunk_bytes));
  const std::string shm_name = absl::StrCat("remote_shm/chunk:", BytesName(chunk_bytes));
  auto reg = [&](const std::string& name, ForwardFn fn,
                 const local::LocalExpertCluster* experts) {
    benchmark::RegisterBenchmark(name.c_str(), [fn, tokens, experts](benchmark::State& s) {
      RunForwards(s, fn, tokens, experts);
    })->Unit(benchmark::kMillisecond)->UseRealTime()->MeasureProcessCPUTime();
  };
  reg(local_name, [&] { return local->Forward(x, /*training=*/false); }, nullptr);
  reg(fp32_name, [&] { return remote_fp32->Forward(0, x); }, cluster.get());
  reg(bf16_name, [&] { return remote_bf16->Forward(0, x); }, cluster.get());
  reg(shm_name, [&] { return remote_shm->Forward(0, x); }, cluster.get());
  for (size_t i = 0; i < swept.size(); ++i) {
    RemoteMoE* r = swept[i].get();
    reg(absl::StrCat("remote_fp32/chunk:", BytesName(sweep[i])),
        [r, &x] { return r->Forward(0, x); }, cluster.get());
  }

  CapturingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  auto rate = [&](const std::string& name) { return reporter.rate(name); };
  const double local_rate = rate(local_name);
  if (local_rate > 0) {
    std::printf("\ntokens/s: local %.0f, remote_fp32 %.0f, remote_bf16 %.0f, remote_shm %.0f\n",
                local_rate, rate(fp32_name), rate(bf16_name), rate(shm_name));
    for (size_t i = 0; i < sweep.size(); ++i) {
      const std::string name = absl::StrCat("remote_fp32/chunk:", BytesName(sweep[i]));
      if (rate(name) > 0) {
        std::printf("  %s: %.0f tokens/s, ratio %.3f\n", name.c_str(), rate(name),
                    rate(name) / local_rate);
      }
    }
    std::printf("ratio fp32 = %.3f, ratio bf16 = %.3f, ratio shm = %.3f\n",
                rate(fp32_name) / local_rate, rate(bf16_name) / local_rate,
                rate(shm_name) / local_rate);
  } else {
    std::printf("\n(no ratio: the local benchmark did not run; see --benchmark_filter)\n");
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace himoe::bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);  // takes the --benchmark_* flags
  absl::ParseCommandLine(argc, argv);  // then ours; unknown flags exit here
  const absl::Status status = himoe::bench::Run();
  benchmark::Shutdown();
  if (!status.ok()) {
    std::fprintf(stderr, "himoe-bench: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
