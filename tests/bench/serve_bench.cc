// himoe-serve-bench: serving ratios, each measured in this one run
// (scripts/bench.sh serve writes the table to runs/bench/serve.md).
//
//   * RouteForward throughput of 64 closed-loop clients of 16 tokens, dynamic
//     batching on (the defaults; and with 1 batch in flight) / off (one
//     request per batch);
//   * p50/p99 latency at half the batched throughput, offered at fixed
//     intervals by 16 clients;
//   * the grouped+bias router (himoe, Route only, T 4096, N 64, M 4, k 1) /
//     flat top-K (vanilla, same N, K 4);
//   * tensor codec encode+decode / memcpy of the same bytes (4 MiB), the
//     decode taking the message's bytes (clients) and copying them (services).
// (scripts/bench.sh serve then adds remote / local per token as M grows,
// from himoe-bench, whose experts are separate processes.)
//
// The serving model is the shipped cluster file's (d_model 256, d_ff 1024,
// N 8, M 4, k 1, 2 layers). Expert services and the router run in this
// process on loopback ports (gRPC and the tensor codec are all there; the
// services share this process's cores and its --threads torch threads).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/compute_setup.h"
#include "common/program.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "expert_service/expert_grpc_service.h"
#include "himoe/v1/router.grpc.pb.h"
#include "router_service/router_grpc_service.h"
#include "router_service/routing/router_layer.h"

ABSL_FLAG(int32_t, threads, 1,
          "torch threads of this process, which every service in it shares (1: as the "
          "cluster file's share gives each service on a small host; more makes their "
          "OpenMP teams contend)");
ABSL_FLAG(double, seconds, 3, "length of each throughput and latency run");
ABSL_FLAG(int32_t, max_batches_in_flight, 2, "the router's router.max_batches_in_flight");
ABSL_FLAG(std::string, out, "", "also write the table here");

namespace himoe {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

v1::ExpertShape Shape(int n, int m, int layers) {
  v1::ExpertShape s;
  s.set_num_experts(n);
  s.set_num_groups(m);
  s.set_num_layers(layers);
  s.set_d_model(256);
  s.set_d_ff(1024);
  s.set_seed(5);
  s.set_dtype(v1::DTYPE_FLOAT32);
  return s;
}

router::RoutingConfig Routing(router::RoutingMethod method, int n, int m) {
  router::RoutingConfig c;
  c.method = method;
  c.num_experts = n;
  c.num_groups = m;
  c.top_k = 1;
  return c;
}

struct Experts {
  std::vector<std::unique_ptr<expert::ExpertServer>> servers;
  std::vector<expert::ExpertGroupClientOptions> groups;
};

absl::StatusOr<Experts> StartExperts(const v1::ExpertShape& shape) {
  Experts e;
  for (int g = 0; g < shape.num_groups(); ++g) {
    expert::ExpertServerOptions o;
    o.core.shape = shape;
    o.core.group_id = g;
    o.address = "127.0.0.1:0";
    HIMOE_ASSIGN_OR_RETURN(auto server, expert::ExpertServer::Start(o));
    expert::ExpertGroupClientOptions go;
    go.group_id = g;
    go.addresses = {server->address()};
    go.deadline = std::chrono::milliseconds(60000);
    e.groups.push_back(go);
    e.servers.push_back(std::move(server));
  }
  return e;
}

// Closed-loop (`interval` 0) or fixed-interval clients of `tokens`-row
// RouteForward calls for `seconds`; latencies of the OK calls.
struct Load {
  std::vector<double> latencies;
  int64_t errors = 0;
  double seconds = 0;
};

Load RunLoad(int port, int clients, int64_t tokens, double seconds, double interval) {
  const auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                           grpc::InsecureChannelCredentials());
  v1::RouteForwardRequest request;
  request.set_layer(0);
  EncodeTensor(at::randn({tokens, 256}), request.mutable_hidden()).IgnoreError();
  std::vector<std::vector<double>> latencies(clients);
  std::atomic<int64_t> errors{0};
  const Clock::time_point start = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      auto stub = v1::RouterService::NewStub(channel);
      Clock::time_point next = start + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(interval * c / clients));
      while (Since(start) < seconds) {
        if (interval > 0) {
          std::this_thread::sleep_until(next);
          next += std::chrono::duration_cast<Clock::duration>(
              std::chrono::duration<double>(interval));
        }
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
        v1::RouteForwardResponse response;
        const Clock::time_point t0 = Clock::now();
        const grpc::Status status = stub->RouteForward(&context, request, &response);
        if (status.ok()) {
          latencies[c].push_back(Since(t0));
        } else if (++errors == 1) {
          std::fprintf(stderr, "RouteForward (%d clients, interval %g s): %s after %.3f s\n",
                       clients, interval, status.error_message().c_str(), Since(t0));
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  Load load;
  load.seconds = Since(start);
  for (auto& l : latencies) load.latencies.insert(load.latencies.end(), l.begin(), l.end());
  load.errors = errors.load();
  return load;
}

absl::StatusOr<std::unique_ptr<router::RouterServer>> StartRouter(const Experts& experts,
                                                                   const v1::ExpertShape& shape,
                                                                   bool batching,
                                                                   int batches_in_flight) {
  router::RouterServerOptions o;
  o.moe.routing = Routing(router::RoutingMethod::kHiMoe, shape.num_experts(), shape.num_groups());
  o.moe.shape = shape;
  o.moe.groups = experts.groups;
  o.batching.max_batches_in_flight = batches_in_flight;
  if (!batching) {
    o.batching.max_batch_tokens = 1;  // one request per batch
    o.batching.max_queue_delay = std::chrono::microseconds(0);
  }
  return router::RouterServer::Start(o);
}

absl::Status Run() {
  HIMOE_RETURN_IF_ERROR(ConfigureServingCompute(absl::GetFlag(FLAGS_threads), true));
  at::NoGradGuard no_grad;
  const double seconds = absl::GetFlag(FLAGS_seconds);
  std::string table = absl::StrFormat(
      "| serving (d_model 256, d_ff 1024, N 8, M 4, k 1; services in process) | value | ratio |\n"
      "|---|---|---|\n");

  // 1, 2: RouteForward throughput and latency.
  const v1::ExpertShape shape = Shape(8, 4, 2);
  HIMOE_ASSIGN_OR_RETURN(Experts experts, StartExperts(shape));
  double batched_rps = 0;
  {
    const int in_flight = absl::GetFlag(FLAGS_max_batches_in_flight);
    HIMOE_ASSIGN_OR_RETURN(auto off, StartRouter(experts, shape, false, in_flight));
    const Load unbatched = RunLoad(off->port(), 64, 16, seconds, 0);
    off.reset();
    HIMOE_ASSIGN_OR_RETURN(auto one, StartRouter(experts, shape, true, 1));
    const Load one_in_flight = RunLoad(one->port(), 64, 16, seconds, 0);
    one.reset();
    HIMOE_ASSIGN_OR_RETURN(auto on, StartRouter(experts, shape, true, in_flight));
    const Load batched = RunLoad(on->port(), 64, 16, seconds, 0);
    const double off_tps = 16.0 * unbatched.latencies.size() / unbatched.seconds;
    const double one_tps = 16.0 * one_in_flight.latencies.size() / one_in_flight.seconds;
    const double on_tps = 16.0 * batched.latencies.size() / batched.seconds;
    batched_rps = batched.latencies.size() / batched.seconds;
    absl::StrAppendFormat(
        &table,
        "| RouteForward, 64 clients x 16 tokens, batching off: tokens/s | %.0f | 1.00 |\n"
        "| the same, batching on, 1 batch in flight: tokens/s | %.0f | %.2f |\n"
        "| the same, batching on, %d batches in flight: tokens/s | %.0f | %.2f |\n",
        off_tps, one_tps, one_tps / off_tps, in_flight, on_tps, on_tps / off_tps);
    if (one_in_flight.errors > 0) {
      return absl::InternalError(absl::StrCat(one_in_flight.errors, " RouteForward calls failed"));
    }
    const double offered = 0.5 * batched_rps;
    const Load paced = RunLoad(on->port(), 16, 16, seconds, 16.0 / offered);
    absl::StrAppendFormat(
        &table, "| latency at %.0f requests/s (half of that), p50 / p99 ms | %.2f / %.2f | %.2f |\n",
        offered, 1e3 * Percentile(paced.latencies, 0.5), 1e3 * Percentile(paced.latencies, 0.99),
        Percentile(paced.latencies, 0.99) / Percentile(paced.latencies, 0.5));
    if (unbatched.errors + batched.errors + paced.errors > 0) {
      return absl::InternalError(absl::StrCat(unbatched.errors + batched.errors + paced.errors,
                                              " RouteForward calls failed"));
    }
  }
  experts.servers.clear();

  // 3: grouped+bias routing against flat top-K.
  {
    const at::Tensor x = at::randn({4096, 256});
    std::vector<double> grouped, flat;
    std::vector<std::unique_ptr<router::RouterLayer>> layers;
    for (const auto method : {router::RoutingMethod::kHiMoe, router::RoutingMethod::kVanilla}) {
      router::RouterLayerOptions ro;
      ro.config = Routing(method, 64, 4);
      ro.d_model = 256;
      ro.seed = 3;
      HIMOE_ASSIGN_OR_RETURN(auto layer, router::RouterLayer::Create(ro));
      layers.push_back(std::move(layer));
    }
    for (int rep = 0; rep < 21; ++rep) {
      for (int i = 0; i < 2; ++i) {
        const Clock::time_point t0 = Clock::now();
        HIMOE_RETURN_IF_ERROR(layers[i]->Route(x, false).status());
        (i == 0 ? grouped : flat).push_back(Since(t0));
      }
    }
    absl::StrAppendFormat(&table,
                          "| Route, T 4096, N 64: grouped+bias (himoe, M 4, k 1) / flat top-4, ms "
                          "| %.2f / %.2f | %.2f |\n",
                          1e3 * Median(grouped), 1e3 * Median(flat), Median(grouped) / Median(flat));
  }

  // 4: the tensor codec against memcpy. Clients and services own the
  // messages they decode, so both take their bytes (TakeTensor); the copying
  // decode (DecodeTensor, for const messages) is shown beside it.
  {
    const at::Tensor x = at::randn({4096, 256});
    std::vector<char> copy(x.nbytes());
    std::vector<double> taking, copying, memcpy_s;
    for (int rep = 0; rep < 51; ++rep) {
      Clock::time_point t0 = Clock::now();
      {
        v1::Tensor proto;
        HIMOE_RETURN_IF_ERROR(EncodeTensor(x, &proto));
        HIMOE_RETURN_IF_ERROR(TakeTensor(&proto, "bench").status());
      }
      taking.push_back(Since(t0));
      t0 = Clock::now();
      {
        v1::Tensor proto;
        HIMOE_RETURN_IF_ERROR(EncodeTensor(x, &proto));
        HIMOE_RETURN_IF_ERROR(DecodeTensor(proto, "bench").status());
      }
      copying.push_back(Since(t0));
      t0 = Clock::now();
      std::memcpy(copy.data(), x.data_ptr(), x.nbytes());
      memcpy_s.push_back(Since(t0));
    }
    absl::StrAppendFormat(
        &table,
        "| tensor codec encode + decode taking the bytes (clients and services) / memcpy, 4 "
        "MiB, ms | %.3f / %.3f | %.2f |\n"
        "| tensor codec encode + decode copying (a const message) / memcpy, 4 MiB, ms | "
        "%.3f / %.3f | %.2f |\n",
        1e3 * Median(taking), 1e3 * Median(memcpy_s), Median(taking) / Median(memcpy_s),
        1e3 * Median(copying), 1e3 * Median(memcpy_s), Median(copying) / Median(memcpy_s));
  }

  std::fputs(table.c_str(), stdout);
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) std::ofstream(out) << table;
  return absl::OkStatus();
}

}  // namespace
}  // namespace himoe

int main(int argc, char** argv) {
  himoe::ParseCommandLine(argc, argv, "Serving ratios, measured in one run.");
  const absl::Status s = himoe::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "himoe-serve-bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
