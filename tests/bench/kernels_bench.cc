// himoe-kernels-bench: the project's own CPU loops at 1 and 2 threads, on the
// released code's shapes (block 128, batch 16, d 128, 4 heads, 4 groups of
// k 1, expert width 512). It starts with the trainer's compute set-up (BLAS
// kernels, 2 threads), whose summary line gives the machine's GEMM rate.
// `scripts/bench.sh kernels` runs it and tabulates each loop's 2 / 1 thread
// speed-up (a loop that does not use the second thread shows about 1), and
// a decoding step's expert product on cold weights, BLAS against the
// small-rows loop.
#include <cstdint>
#include <iostream>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <c10/core/InferenceMode.h>

#include "common/compute_setup.h"
#include "common/gelu.h"
#include "common/linear.h"
#include "common/squared_norm.h"
#include "model/attention.h"
#include "router_service/routing/dispatch_combine.h"
#include "router_service/routing/router_layer.h"

namespace himoe {
namespace {

constexpr int64_t kBatch = 16, kBlock = 128, kDModel = 128, kHeads = 4, kGroups = 4;
constexpr int64_t kTokens = kBatch * kBlock, kWidth = 512;

void Threads(benchmark::State& state) { at::set_num_threads(static_cast<int>(state.range(0))); }

// Forward and backward of one block's causal attention; FLOPs counted as the
// trainer's MFU counts them (the full T x T products, 3 x forward).
void BM_Attention(benchmark::State& state) {
  Threads(state);
  const at::Tensor qkv = at::randn({kBatch, kBlock, 3 * kDModel}).requires_grad_(true);
  const at::Tensor gy = at::randn({kBatch, kBlock, kDModel});
  for (auto _ : state) {
    model::CausalSelfAttention(qkv, kHeads).backward(gy);
    qkv.mutable_grad().reset();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      3.0 * 2 * 2 * kBatch * kBlock * kBlock * kDModel * 1e-9,
      benchmark::Counter::kIsIterationInvariantRate);
}

// Dispatch to 4 groups and combine their outputs, forward and backward, on
// the router's plan (BuildDispatchPlan: a group's rows sorted by expert) for
// a random choice of one of the 2 experts in every group.
void BM_DispatchCombine(benchmark::State& state) {
  Threads(state);
  const at::Tensor group_base = at::arange(kGroups, at::kLong) * 2;
  const at::Tensor ids = at::randint(2, {kTokens, kGroups}, at::kLong) + group_base;
  std::vector<router::GroupDispatch> groups = router::BuildDispatchPlan(
      ids, at::rand({kTokens, kGroups}), at::ones({kTokens, kGroups}, at::kBool), kGroups, 2);
  for (router::GroupDispatch& g : groups) g.weights.requires_grad_(true);
  const at::Tensor x = at::randn({kTokens, kDModel}).requires_grad_(true);
  const at::Tensor gy = at::randn({kTokens, kDModel});
  for (auto _ : state) {
    const std::vector<at::Tensor> rows = router::DispatchGroupRows(x, groups);
    router::CombineGroupOutputs(kTokens, kDModel, groups, rows).backward(gy);
    x.mutable_grad().reset();
  }
  state.SetItemsProcessed(state.iterations() * kTokens);
}

// The experts' exact GELU and its backward on one group's hidden rows.
void BM_Gelu(benchmark::State& state) {
  Threads(state);
  const at::Tensor h = at::randn({kTokens, kWidth}), g = at::randn({kTokens, kWidth});
  at::Tensor y = at::empty_like(h), gh = at::empty_like(h);
  for (auto _ : state) {
    GeluOut(y, h);
    GeluBackwardOut(gh, g, h);
  }
  state.SetItemsProcessed(state.iterations() * h.numel());
}

// The gradient-clipping norm over one layer's experts' weights.
void BM_SquaredNorm(benchmark::State& state) {
  Threads(state);
  const at::Tensor w = at::randn({8 * 2 * kDModel * kWidth});
  for (auto _ : state) benchmark::DoNotOptimize(SquaredNorm(w));
  state.SetItemsProcessed(state.iterations() * w.numel());
}


// A decoding step's expert product, x [R, 256] times a [1024, 256] weight
// (an expert's first matrix), with the weight cold: 64 such weights (64 MiB,
// more than the last-level cache) in turn, as 4 expert processes' 32 MiB of
// weights are between one step's uses. range(0): rows; range(1): 0 BLAS
// (at::addmm, as the experts call it), 1 the project's small-rows loop.
void BM_ColdWeightLinear(benchmark::State& state) {
  at::set_num_threads(1);
  const int64_t rows = state.range(0);
  std::vector<at::Tensor> weights;
  for (int i = 0; i < 64; ++i) weights.push_back(at::randn({1024, 256}));
  const at::Tensor bias = at::randn({1024}), x = at::randn({rows, 256});
  at::Tensor out = at::empty({rows, 1024});
  size_t next = 0;
  for (auto _ : state) {
    const at::Tensor& w = weights[next++ % weights.size()];
    if (state.range(1) == 0) {
      at::addmm_out(out, bias, x, w.t());
    } else {
      out = SmallRowsLinear(x, w, bias);
    }
    benchmark::DoNotOptimize(out.data_ptr<float>());
  }
  state.SetBytesProcessed(state.iterations() * 1024 * 256 * 4);
}

// Routing one decoding step in inference mode: the generate benches' model,
// N 8 in M 4 groups, k 1, d 256. range(0): rows (streams in the step);
// range(1): 0 with the losses and every statistic (evaluation), 1 as the
// router service routes (RouterLayerOptions::serving).
void BM_RouteDecodingStep(benchmark::State& state) {
  at::set_num_threads(1);
  router::RouterLayerOptions options;
  options.config.method = router::RoutingMethod::kHiMoe;
  options.config.num_experts = 8;
  options.config.num_groups = 4;
  options.config.top_k = 1;
  options.d_model = 256;
  options.serving = state.range(1) == 1;
  auto layer = router::RouterLayer::Create(options);
  if (!layer.ok()) {
    state.SkipWithError(layer.status().ToString().c_str());
    return;
  }
  const at::Tensor x = at::randn({state.range(0), 256});
  c10::InferenceMode inference;
  for (auto _ : state) {
    auto routed = (*layer)->Route(x, /*training=*/false);
    benchmark::DoNotOptimize(routed->weights.data_ptr<float>());
  }
}

BENCHMARK(BM_Attention)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_DispatchCombine)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Gelu)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SquaredNorm)->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ColdWeightLinear)
    ->ArgsProduct({{1, 4, 8}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RouteDecodingStep)
    ->ArgsProduct({{1, 8}, {0, 1}})
    ->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace himoe

// The BLAS kernels the trainer would pick (BLIS falls back to its generic
// ones on CPUs it does not know), then the benchmarks.
int main(int argc, char** argv) {
  himoe::ComputeOptions options;
  options.threads = 2;
  const absl::StatusOr<himoe::ComputeSetup> setup = himoe::ConfigureCompute(options);
  if (!setup.ok()) {
    std::cerr << "himoe-kernels-bench: " << setup.status() << "\n";
    return 1;
  }
  std::cerr << setup->Summary() << "\n";
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
