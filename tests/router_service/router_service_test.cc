// The router over real gRPC on 127.0.0.1 in front of 4 in-process expert
// services, checked against LocalMoE on the same weights and inputs.
#include <atomic>
#include <chrono>
#include <future>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <prometheus/registry.h>

#include "absl/strings/str_cat.h"
#include "common/metrics_endpoint.h"
#include "common/tensor_codec.h"
#include "expert_service/expert_grpc_service.h"
#include "proto/grpc_status.h"
#include "router_service/remote_moe.h"
#include "router_service/router_grpc_service.h"
#include "router_service/routing/local_moe.h"
#include "tests/http_get.h"
#include "tests/raw_grpc_call.h"
#include "tests/router_service/expert_cluster_util.h"
#include "tests/router_service/routing/routing_test_util.h"

namespace himoe::router {
namespace {

using ::testing::HasSubstr;

using testing::kD;
using testing::kDff;
using testing::kK;
using testing::kLayers;
using testing::kM;
using testing::kN;
using testing::kSeed;
using testing::Loopback;
using testing::StartExpert;

class RouterServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int g = 0; g < kM; ++g) experts_.push_back(StartExpert(g));
  }

  RouterServerOptions Options(RoutingMethod method) {
    RouterServerOptions o;
    o.moe.routing = testing::Config(method, kN, kM, kK);
    o.moe.shape = testing::Shape();
    for (int g = 0; g < kM; ++g) {
      expert::ExpertGroupClientOptions go;
      go.addresses = {Loopback(experts_[g]->port())};
      go.deadline = std::chrono::milliseconds(5000);
      o.moe.groups.push_back(go);
    }
    o.max_tokens_per_request = 512;
    return o;
  }

  void StartRouter(const RouterServerOptions& o) {
    auto router = RouterServer::Start(o);
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = std::move(router).value();
    stub_ = v1::RouterService::NewStub(
        grpc::CreateChannel(Loopback(router_->port()), grpc::InsecureChannelCredentials()));
  }

  absl::StatusOr<v1::RouteForwardResponse> Call(const v1::RouteForwardRequest& request) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::RouteForwardResponse response;
    const absl::Status s = FromGrpcStatus(stub_->RouteForward(&context, request, &response));
    if (!s.ok()) return s;
    return response;
  }

  absl::StatusOr<v1::RouteForwardResponse> Route(int layer, const at::Tensor& x,
                                                 bool routing = false) {
    v1::RouteForwardRequest request;
    request.set_layer(layer);
    request.set_return_routing(routing);
    EXPECT_TRUE(EncodeTensor(x, request.mutable_hidden()).ok());
    return Call(request);
  }

  // Layer 0 of every input, each from its own client thread at once.
  void RouteConcurrently(const std::vector<at::Tensor>& inputs, std::vector<at::Tensor>* outputs) {
    outputs->assign(inputs.size(), at::Tensor());
    std::vector<absl::Status> status(inputs.size());
    std::vector<std::thread> threads;
    for (size_t c = 0; c < inputs.size(); ++c) {
      threads.emplace_back([&, c] {
        auto r = Route(0, inputs[c]);
        status[c] = r.status();
        if (r.ok()) (*outputs)[c] = Output(*r);
      });
    }
    for (auto& t : threads) t.join();
    for (size_t c = 0; c < inputs.size(); ++c) ASSERT_TRUE(status[c].ok()) << c << ": " << status[c];
  }

  // LocalMoE of layer `layer` with the router's routing config.
  MoEOutput Reference(const RoutingConfig& routing, int layer, const at::Tensor& x) {
    LocalMoEOptions o;
    o.routing = routing;
    o.shape = testing::Shape();
    o.layer = layer;
    auto moe = LocalMoE::Create(o);
    EXPECT_TRUE(moe.ok()) << moe.status();
    at::NoGradGuard no_grad;
    auto out = (*moe)->Forward(x, /*training=*/false);
    EXPECT_TRUE(out.ok()) << out.status();
    return std::move(out).value();
  }

  static at::Tensor Output(const v1::RouteForwardResponse& r) {
    auto y = DecodeTensor(r.output(), "output");
    EXPECT_TRUE(y.ok()) << y.status();
    return y.ok() ? *y : at::Tensor();
  }

  std::vector<std::unique_ptr<expert::ExpertServer>> experts_;
  std::unique_ptr<RouterServer> router_;
  std::unique_ptr<v1::RouterService::Stub> stub_;
};

double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

class RouterEqualityTest : public RouterServiceTest,
                           public ::testing::WithParamInterface<RoutingMethod> {};

TEST_P(RouterEqualityTest, MatchesLocalMoEForEveryLayer) {
  StartRouter(Options(GetParam()));
  at::manual_seed(1);
  for (int layer = 0; layer < kLayers; ++layer) {
    const at::Tensor x = at::randn({64, kD});
    auto got = Route(layer, x, /*routing=*/true);
    ASSERT_TRUE(got.ok()) << got.status();
    const MoEOutput want = Reference(Options(GetParam()).moe.routing, layer, x);
    EXPECT_LE(MaxAbsDiff(Output(*got), want.output), 1e-5) << "layer " << layer;
    EXPECT_GT(want.output.abs().max().item<double>(), 0.0);
    auto ids = DecodeTensor(got->expert_ids(), "expert_ids");
    auto weights = DecodeTensor(got->weights(), "weights");
    ASSERT_TRUE(ids.ok() && weights.ok());
    EXPECT_TRUE(at::equal(*ids, want.routing.expert_ids));
    EXPECT_LE(MaxAbsDiff(*weights, want.routing.weights), 1e-6);
  }
}

INSTANTIATE_TEST_SUITE_P(Methods, RouterEqualityTest,
                         ::testing::ValuesIn(testing::kAllMethods), testing::MethodParamName);

TEST_F(RouterServiceTest, ChunkedDispatchMatchesLocalMoE) {
  RouterServerOptions o = Options(RoutingMethod::kHiMoe);
  o.moe.chunk_bytes = 10 * kD * 4;  // 10 rows per message: many messages per group
  StartRouter(o);
  const at::Tensor x = at::randn({200, kD});
  auto got = Route(1, x);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_LE(MaxAbsDiff(Output(*got), Reference(o.moe.routing, 1, x).output), 1e-5);
}

// router.shared_memory: the rows and outputs go through regions the router
// leases, the same outputs as LocalMoE. A group's regions are reused from
// one request to the next; past kSharedRegionsPerGroup calls in flight, a
// call sends its bytes inline.
TEST_F(RouterServiceTest, SharedMemoryMatchesLocalMoEAndReusesItsRegions) {
  experts_.clear();
  for (int g = 0; g < kM; ++g) experts_.push_back(StartExpert(g, "127.0.0.1:0", true));
  for (const int64_t chunk_rows : {int64_t{0}, int64_t{10}}) {
    RouterServerOptions o = Options(RoutingMethod::kHiMoe);
    o.moe.shared_memory = true;
    if (chunk_rows > 0) o.moe.chunk_bytes = chunk_rows * kD * 4;
    StartRouter(o);
    const expert::SharedRegionPool* regions = router_->moe().shared_regions();
    ASSERT_NE(regions, nullptr);
    for (int request = 0; request < 3; ++request) {
      const at::Tensor x = at::randn({200, kD});
      auto got = Route(request % kLayers, x);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_LE(MaxAbsDiff(Output(*got), Reference(o.moe.routing, request % kLayers, x).output),
                1e-5);
      // k = 1 in every group: each gets all 200 rows, in one call, or in 20
      // of 10 rows of which the first 8 lease a region each.
      for (int g = 0; g < kM; ++g) {
        EXPECT_EQ(regions->regions(g), chunk_rows > 0 ? RemoteMoE::kSharedRegionsPerGroup : 1)
            << "group " << g << ", request " << request;
      }
    }
  }
}

TEST_F(RouterServiceTest, SharedMemoryToGroupsWithoutItFailsNamingTheFlag) {
  RouterServerOptions o = Options(RoutingMethod::kHiMoe);
  o.moe.shared_memory = true;
  StartRouter(o);
  auto got = Route(0, at::randn({8, kD}));
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(got.status().message(), HasSubstr("--shared_memory"));
  EXPECT_THAT(got.status().message(), HasSubstr("expert group"));
  // A failed call's region is dropped (a late answer may still write it).
  for (int g = 0; g < kM; ++g) EXPECT_EQ(router_->moe().shared_regions()->regions(g), 0u);
}

TEST_F(RouterServiceTest, Bf16OnTheWireWithinDocumentedTolerance) {
  RouterServerOptions o = Options(RoutingMethod::kHiMoe);
  o.moe.wire_dtype = at::kBFloat16;
  StartRouter(o);
  const at::Tensor x = at::randn({64, kD});
  auto got = Route(0, x.to(at::kBFloat16));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->output().dtype(), v1::DTYPE_BFLOAT16);  // answered in the request dtype
  const at::Tensor want = Reference(o.moe.routing, 0, x.to(at::kBFloat16).to(at::kFloat)).output;
  // bf16 rows and outputs on the wire (8-bit mantissa): <= 2e-2 relative (README).
  const double rel = ((Output(*got).to(at::kFloat) - want).norm() / want.norm()).item<double>();
  EXPECT_LT(rel, 2e-2);
}

TEST_F(RouterServiceTest, ConcurrentClientsEachGetTheirOwnRows) {
  RouterServerOptions o = Options(RoutingMethod::kHiMoe);
  o.batching.max_queue_delay = std::chrono::milliseconds(20);
  StartRouter(o);
  constexpr int kClients = 12;
  std::vector<at::Tensor> inputs;
  for (int c = 0; c < kClients; ++c) inputs.push_back(at::randn({3 + 5 * c, kD}));
  std::vector<at::Tensor> outputs;
  ASSERT_NO_FATAL_FAILURE(RouteConcurrently(inputs, &outputs));
  for (int c = 0; c < kClients; ++c) {
    EXPECT_LE(MaxAbsDiff(outputs[c], Reference(o.moe.routing, 0, inputs[c]).output), 1e-5)
        << "client " << c;
  }
}

// With a capacity factor (and st_moe's random drop) a request's drops would
// depend on whatever it was batched with; each request is routed as if alone,
// so concurrent callers still equal LocalMoE on their own rows.
TEST_F(RouterServiceTest, WithCapacityConcurrentCallersEqualTheirCallsAlone) {
  for (const RoutingMethod method : {RoutingMethod::kHiMoe, RoutingMethod::kStMoe}) {
    SCOPED_TRACE(std::string(RoutingMethodName(method)));
    RouterServerOptions o = Options(method);
    o.moe.routing.capacity_factor = 0.5;
    if (method == RoutingMethod::kStMoe) o.moe.routing.second_choice_threshold = 0.2;
    o.batching.max_queue_delay = std::chrono::milliseconds(50);
    StartRouter(o);
    constexpr int kClients = 8;
    std::vector<at::Tensor> inputs;
    for (int c = 0; c < kClients; ++c) inputs.push_back(at::randn({4 + 3 * c, kD}));
    std::vector<at::Tensor> outputs;
    ASSERT_NO_FATAL_FAILURE(RouteConcurrently(inputs, &outputs));
    std::cout << kClients << " requests in " << router_->batcher().batches() << " batches\n";
    for (int c = 0; c < kClients; ++c) {
      EXPECT_LE(MaxAbsDiff(outputs[c], Reference(o.moe.routing, 0, inputs[c]).output), 1e-5)
          << "client " << c;
    }
    router_.reset();
  }
}

struct BadInput {
  const char* name;
  std::function<void(v1::RouteForwardRequest&)> mutate;
  const char* message;
};

TEST_F(RouterServiceTest, BadInputIsInvalidArgumentAndServerKeepsServing) {
  StartRouter(Options(RoutingMethod::kHiMoe));
  const BadInput cases[] = {
      {"wrong d", [](auto& r) { EncodeTensor(at::randn({4, kD + 1}), r.mutable_hidden()).IgnoreError(); },
       "hidden.shape: expected [T, d_model=32], got [4, 33]"},
      {"unknown dtype", [](auto& r) { r.mutable_hidden()->set_dtype(static_cast<v1::DType>(42)); },
       "hidden.dtype: unknown or unspecified value 42"},
      {"int dtype", [](auto& r) { EncodeTensor(at::ones({4, kD}, at::kLong), r.mutable_hidden()).IgnoreError(); },
       "hidden.dtype: expected FLOAT32 or BFLOAT16"},
      {"byte length", [](auto& r) { r.mutable_hidden()->mutable_data()->resize(7); },
       "hidden.data has 7 bytes; shape [4,32] of Float needs 512"},
      {"NaN", [](auto& r) {
         at::Tensor x = at::randn({4, kD}); x[2][3] = NAN;
         EncodeTensor(x, r.mutable_hidden()).IgnoreError(); },
       "hidden contains NaN or Inf"},
      {"Inf", [](auto& r) {
         at::Tensor x = at::randn({4, kD}); x[0][0] = -INFINITY;
         EncodeTensor(x, r.mutable_hidden()).IgnoreError(); },
       "hidden contains NaN or Inf"},
      {"finite but huge", [](auto& r) { EncodeTensor(at::full({4, kD}, 3e38), r.mutable_hidden()).IgnoreError(); },
       "not finite (NaN or Inf)"},
      {"empty batch", [](auto& r) { EncodeTensor(at::zeros({0, kD}), r.mutable_hidden()).IgnoreError(); },
       "hidden: empty batch (T = 0)"},
      {"unknown layer", [](auto& r) { r.set_layer(5); }, "layer: 5 is not served; layers are [0, 2)"},
      {"over token limit", [](auto& r) { EncodeTensor(at::randn({513, kD}), r.mutable_hidden()).IgnoreError(); },
       "hidden: 513 tokens exceed the limit of 512 per request"},
  };
  for (const BadInput& bad : cases) {
    v1::RouteForwardRequest request;
    ASSERT_TRUE(EncodeTensor(at::randn({4, kD}), request.mutable_hidden()).ok());
    bad.mutate(request);
    auto r = Call(request);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad.name;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(bad.message)) << bad.name;
    // Still serving, correctly.
    const at::Tensor x = at::randn({5, kD});
    auto good = Route(0, x);
    ASSERT_TRUE(good.ok()) << bad.name << ": " << good.status();
    EXPECT_LE(MaxAbsDiff(Output(*good), Reference(Options(RoutingMethod::kHiMoe).moe.routing, 0, x).output), 1e-5);
  }
}

// Bytes that are not the request message get INVALID_ARGUMENT naming it, on
// every method (the typed callback API answered UNIMPLEMENTED with no
// message). Generate parses before it looks for a model.
TEST_F(RouterServiceTest, UnparsableRequestBytesAreInvalidArgument) {
  StartRouter(Options(RoutingMethod::kHiMoe));
  const auto channel =
      grpc::CreateChannel(Loopback(router_->port()), grpc::InsecureChannelCredentials());
  const std::pair<const char*, const char*> calls[] = {
      {"RouteForward", "RouteForwardRequest"},
      {"Info", "RouterInfoRequest"},
      {"Generate", "GenerateRequest"}};
  // Field 2^32 - 1 with wire type 7, which no message has.
  const std::string garbage = "\xff\xff\xff\xff\x0f not a protobuf message";
  for (const auto& [method, message] : calls) {
    const testutil::RawCallResult r =
        testutil::RawCall(channel, absl::StrCat("/himoe.v1.RouterService/", method), {garbage});
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_EQ(r.status.error_message(), absl::StrCat("request: ", garbage.size(),
                                                     " bytes do not parse as himoe.v1.", message))
        << method;
    EXPECT_TRUE(r.replies.empty()) << method;
  }
  // A well-formed Generate gets to the model check.
  const testutil::RawCallResult no_model = testutil::RawCall(
      channel, "/himoe.v1.RouterService/Generate", {v1::GenerateRequest().SerializeAsString()});
  EXPECT_EQ(no_model.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  const at::Tensor x = at::randn({5, kD});
  auto good = Route(0, x);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_LE(MaxAbsDiff(Output(*good), Reference(Options(RoutingMethod::kHiMoe).moe.routing, 0, x).output), 1e-5);
}

TEST_F(RouterServiceTest, DeadGroupIsUnavailableNamingItThenRecovers) {
  StartRouter(Options(RoutingMethod::kHiMoe));
  const at::Tensor x = at::randn({32, kD});  // himoe: every group gets rows
  const auto before = Route(0, x);
  ASSERT_TRUE(before.ok()) << before.status();
  const int port = experts_[2]->port();
  experts_[2].reset();  // kill group 2
  auto down = Route(0, x);
  EXPECT_EQ(down.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(down.status().message()), HasSubstr("expert group 2"));
  EXPECT_THAT(std::string(down.status().message()), HasSubstr(Loopback(port)));
  // The group comes back on the same address; the router reconnects by itself.
  experts_[2] = StartExpert(2, Loopback(port));
  ASSERT_NE(experts_[2], nullptr);
  absl::StatusOr<v1::RouteForwardResponse> up = down.status();
  for (int attempt = 0; attempt < 100 && !up.ok(); ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    up = Route(0, x);
  }
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_LE(MaxAbsDiff(Output(*up), Reference(Options(RoutingMethod::kHiMoe).moe.routing, 0, x).output), 1e-5);
}

// Counts what RemoteMoE reports of changed weights.
struct WeightsObserver : ForwardObserver {
  void OnRouted(int, const RoutingStats&) override {}
  void OnGroupDispatch(int, double, int64_t) override {}
  void OnWeightsChanged(int group) override { ++changed[group]; }
  void OnExpertsReloaded(int group, bool ok) override { ++(ok ? reloaded : failed)[group]; }
  std::atomic<int> changed[kM] = {}, reloaded[kM] = {}, failed[kM] = {};
};

// A model the router loaded (LoadExpertState) cannot change under it: an
// outside BeginRun is refused by the group; one that takes it over fails the
// router's next call with FAILED_PRECONDITION naming the group and both
// fingerprints, and the router that reloads serves the loaded model again
// (its failed call is UNAVAILABLE: retry).
TEST_F(RouterServiceTest, AServedModelCannotChangeSilently) {
  RouterServerOptions o = Options(RoutingMethod::kHiMoe);
  auto make = [&](bool reload, WeightsObserver* observer) {
    RemoteMoEOptions mo = o.moe;
    mo.reload_changed_experts = reload;
    auto moe = RemoteMoE::Create(mo);
    EXPECT_TRUE(moe.ok()) << moe.status();
    EXPECT_TRUE((*moe)->VerifyGroups(std::chrono::milliseconds(5000)).ok());
    (*moe)->set_observer(observer);
    return std::move(moe).value();
  };
  WeightsObserver plain_seen, reload_seen;
  auto plain = make(false, &plain_seen);
  auto reloading = make(true, &reload_seen);
  // The "checkpoint": every group's seed weights, scaled.
  std::vector<std::vector<NamedTensor>> model(kM);
  for (int g = 0; g < kM; ++g) {
    auto state = plain->group(g).GetState(/*include_optimizer=*/false);
    ASSERT_TRUE(state.ok()) << state.status();
    for (auto& [name, tensor] : *state) model[g].emplace_back(name, tensor * 1.5);
    ASSERT_TRUE(plain->LoadExpertState(g, model[g]).ok());
    ASSERT_TRUE(reloading->LoadExpertState(g, model[g]).ok());
  }
  const std::string loaded = plain->group(1).pinned_weights(0);
  const at::Tensor x = at::randn({32, kD});  // himoe: every group gets rows
  at::NoGradGuard no_grad;
  auto served = plain->Forward(0, x);
  ASSERT_TRUE(served.ok()) << served.status();
  const at::Tensor seed_output = Reference(o.moe.routing, 0, x).output;
  ASSERT_GT(MaxAbsDiff(served->output, seed_output), 1e-3);  // the loaded model is served

  expert::ExpertGroupClientOptions outside;
  outside.group_id = 1;
  outside.addresses = {Loopback(experts_[1]->port())};
  auto intruder = expert::ExpertGroupClient::Create(outside);
  ASSERT_TRUE(intruder.ok());
  const auto refused = (*intruder)->BeginRun("intruder");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("take_over"));
  auto still = plain->Forward(0, x);
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_TRUE(at::equal(still->output, served->output));

  ASSERT_TRUE((*intruder)->BeginRun("intruder", /*take_over=*/true).ok());
  const std::string seed = (*intruder)->Info()->weights_fingerprint();
  for (RemoteMoE* moe : {plain.get(), reloading.get()}) {
    auto changed = moe->Forward(0, x);
    // The reloading router has put the loaded model back: a retry succeeds.
    EXPECT_EQ(changed.status().code(), moe == plain.get() ? absl::StatusCode::kFailedPrecondition
                                                          : absl::StatusCode::kUnavailable)
        << changed.status();
    const std::string message(changed.status().message());
    EXPECT_THAT(message, HasSubstr("expert group 1 at " + Loopback(experts_[1]->port())));
    EXPECT_THAT(message, HasSubstr("serves weights '" + seed + "', not the '" + loaded + "'"));
    EXPECT_EQ(message.find("pushed to it again: retry") != std::string::npos,
              moe == reloading.get());
  }
  EXPECT_EQ(plain_seen.changed[1], 1);
  EXPECT_EQ(reload_seen.changed[1], 1);
  EXPECT_EQ(reload_seen.reloaded[1], 1);
  EXPECT_EQ(plain_seen.changed[0] + plain_seen.changed[2] + plain_seen.changed[3], 0);
  // Reloaded: the loaded model again, for both routers (its fingerprint is
  // the digest of the same weights).
  EXPECT_EQ((*intruder)->Info()->weights_fingerprint(), loaded);
  for (RemoteMoE* moe : {reloading.get(), plain.get()}) {
    auto again = moe->Forward(0, x);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(at::equal(again->output, served->output));
  }
}

// A group down when the model is loaded: without reloading that is the
// load's error; with reload_changed_experts the load succeeds, the group's
// first answer once it is back (its seed weights) fails UNAVAILABLE and
// pushes the model, and the next call is served from it: the output of the
// same model loaded with every group up.
TEST_F(RouterServiceTest, AGroupDownAtLoadGetsTheModelWhenItReturns) {
  RouterServerOptions o = Options(RoutingMethod::kHiMoe);
  o.moe.pin_weights = true;
  for (auto& group : o.moe.groups) group.deadline = std::chrono::milliseconds(2000);
  const at::Tensor x = at::randn({32, kD});  // himoe: every group gets rows
  at::NoGradGuard no_grad;
  std::vector<std::vector<NamedTensor>> model(kM);
  at::Tensor want;
  {
    auto all_up = RemoteMoE::Create(o.moe);
    ASSERT_TRUE(all_up.ok()) << all_up.status();
    for (int g = 0; g < kM; ++g) {
      auto state = (*all_up)->group(g).GetState(/*include_optimizer=*/false);
      ASSERT_TRUE(state.ok()) << state.status();
      for (auto& [name, tensor] : *state) model[g].emplace_back(name, tensor * 1.5);
      ASSERT_TRUE((*all_up)->LoadExpertState(g, model[g]).ok());
    }
    auto served = (*all_up)->Forward(0, x);
    ASSERT_TRUE(served.ok()) << served.status();
    want = served->output;
    ASSERT_GT(MaxAbsDiff(want, Reference(o.moe.routing, 0, x).output), 1e-3);  // not the seed's
  }
  const std::string address = Loopback(experts_[2]->port());
  experts_[2]->Shutdown();
  experts_[2]->Wait();
  for (const bool reload : {false, true}) {
    RemoteMoEOptions mo = o.moe;
    mo.reload_changed_experts = reload;
    auto moe = RemoteMoE::Create(mo);
    ASSERT_TRUE(moe.ok()) << moe.status();
    absl::Status loaded;
    for (int g = 0; g < kM && loaded.ok(); ++g) loaded = (*moe)->LoadExpertState(g, model[g]);
    if (!reload) {
      EXPECT_EQ(loaded.code(), absl::StatusCode::kUnavailable) << loaded;
      EXPECT_THAT(std::string(loaded.message()), HasSubstr("expert group 2 at " + address));
      continue;
    }
    ASSERT_TRUE(loaded.ok()) << loaded;
    experts_[2] = StartExpert(2, address);  // a new process: the seed's weights
    ASSERT_NE(experts_[2], nullptr);
    absl::StatusOr<MoEOutput> first = (*moe)->Forward(0, x);
    for (int i = 0; i < 50 && !first.ok() &&
                    first.status().message().find("weights_fingerprint") == std::string::npos;
         ++i) {  // the channel reconnecting
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      first = (*moe)->Forward(0, x);
    }
    ASSERT_FALSE(first.ok());
    EXPECT_EQ(first.status().code(), absl::StatusCode::kUnavailable) << first.status();
    EXPECT_THAT(std::string(first.status().message()), HasSubstr("expert group 2 at " + address));
    EXPECT_THAT(std::string(first.status().message()), HasSubstr("pushed to it again: retry"));
    auto served = (*moe)->Forward(0, x);
    ASSERT_TRUE(served.ok()) << served.status();
    EXPECT_TRUE(at::equal(served->output, want));
  }
}

// A router serving the groups' weights as they are (pin_weights: a
// checkpoint already in them) pins what each served at start: an outside
// SetState of other weights fails its RouteForward calls. A router that does
// not pin serves whatever the groups hold (a trainer may be training them).
TEST_F(RouterServiceTest, OtherWeightsSetFromOutsideFailTheRoutersCalls) {
  RouterServerOptions follows = Options(RoutingMethod::kHiMoe);
  auto follower = RouterServer::Start(follows);
  ASSERT_TRUE(follower.ok()) << follower.status();
  RouterServerOptions pinned = Options(RoutingMethod::kHiMoe);
  pinned.moe.pin_weights = true;
  StartRouter(pinned);
  const at::Tensor x = at::randn({32, kD});
  ASSERT_TRUE(Route(0, x).ok());
  expert::ExpertGroupClientOptions outside;
  outside.group_id = 3;
  outside.addresses = {Loopback(experts_[3]->port())};
  auto intruder = expert::ExpertGroupClient::Create(outside);
  ASSERT_TRUE(intruder.ok());
  auto state = (*intruder)->GetState(false);
  ASSERT_TRUE(state.ok());
  for (auto& [name, tensor] : *state) tensor = at::zeros_like(tensor);
  ASSERT_TRUE((*intruder)->SetState(*state).ok());
  const auto refused = Route(0, x);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("expert group 3"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("weights_fingerprint"));
  stub_ = v1::RouterService::NewStub(
      grpc::CreateChannel(Loopback((*follower)->port()), grpc::InsecureChannelCredentials()));
  EXPECT_TRUE(Route(0, x).ok());
}

TEST_F(RouterServiceTest, FailsOverToReplica) {
  RouterServerOptions o = Options(RoutingMethod::kHiMoe);
  auto replica = StartExpert(1);
  const int dead_port = experts_[1]->port();
  experts_[1].reset();
  o.moe.groups[1].addresses = {Loopback(dead_port), Loopback(replica->port())};
  StartRouter(o);
  const at::Tensor x = at::randn({32, kD});
  auto got = Route(0, x);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_LE(MaxAbsDiff(Output(*got), Reference(o.moe.routing, 0, x).output), 1e-5);
}

TEST_F(RouterServiceTest, APortAlreadyServedIsRefused) {
  StartRouter(Options(RoutingMethod::kHiMoe));
  RouterServerOptions o = Options(RoutingMethod::kHiMoe);
  o.address = Loopback(router_->port());
  auto second = RouterServer::Start(o);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("cannot listen on " + Loopback(router_->port())));
  // An expert service's port is refused to the router too.
  o.address = Loopback(experts_[0]->port());
  EXPECT_EQ(RouterServer::Start(o).status().code(), absl::StatusCode::kUnavailable);
}

// A group (here a replica) serving experts of another seed would answer with
// other weights: the router refuses to start, naming the address and field.
TEST_F(RouterServiceTest, RefusesAGroupThatServesOtherExperts) {
  expert::ExpertServerOptions eo;
  eo.address = "127.0.0.1:0";
  eo.core.shape = testing::Shape();
  eo.core.shape.set_seed(kSeed + 1);
  eo.core.group_id = 2;
  auto other = expert::ExpertServer::Start(eo);
  ASSERT_TRUE(other.ok()) << other.status();
  RouterServerOptions o = Options(RoutingMethod::kHiMoe);
  o.moe.groups[2].addresses.push_back(Loopback((*other)->port()));
  auto router = RouterServer::Start(o);
  ASSERT_FALSE(router.ok());
  EXPECT_EQ(router.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(router.status().message()),
              HasSubstr(absl::StrCat(Loopback((*other)->port()), " (group 2) serves seed ",
                                     kSeed + 1, "; the model needs seed ", kSeed)));
  o.verify_groups = false;  // the check can be turned off
  EXPECT_TRUE(RouterServer::Start(o).ok());
}

// An expert service that never answers in time.
class StallingExpert final : public v1::ExpertService::CallbackService {
 public:
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* context,
                                    const v1::ExpertForwardRequest*,
                                    v1::ExpertForwardResponse*) override {
    calls.fetch_add(1);
    auto* reactor = context->DefaultReactor();
    std::thread([reactor] {
      std::this_thread::sleep_for(std::chrono::seconds(2));
      reactor->Finish(grpc::Status::OK);
    }).detach();
    return reactor;
  }
  std::atomic<int> calls{0};
};

// `stalling` on 127.0.0.1; *port is its port.
std::unique_ptr<grpc::Server> ServeStalling(StallingExpert& stalling, int* port) {
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), port);
  builder.RegisterService(&stalling);
  return builder.BuildAndStart();
}

TEST_F(RouterServiceTest, SlowGroupIsDeadlineExceededNamingIt) {
  StallingExpert stalling;
  int port = 0;
  auto server = ServeStalling(stalling, &port);
  ASSERT_NE(server, nullptr);
  RouterServerOptions o = Options(RoutingMethod::kHiMoe);
  o.moe.groups[3].addresses = {Loopback(port)};
  o.moe.groups[3].deadline = std::chrono::milliseconds(200);
  StartRouter(o);
  auto r = Route(0, at::randn({16, kD}));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("expert group 3"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(Loopback(port)));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(3));
}

// The client's deadline bounds its whole request: a request that expires
// while it waits behind the batch in flight is not sent to any group.
TEST_F(RouterServiceTest, ARequestThatExpiredInTheQueueIsNotComputed) {
  StallingExpert stalling;
  int port = 0;
  auto server = ServeStalling(stalling, &port);
  ASSERT_NE(server, nullptr);
  RouterServerOptions o = Options(RoutingMethod::kHiMoe);
  o.batching.max_batches_in_flight = 1;  // the second request waits behind the first
  o.moe.groups[3].addresses = {Loopback(port)};
  o.moe.groups[3].deadline = std::chrono::milliseconds(1000);
  o.verify_groups = false;
  StartRouter(o);
  const at::Tensor x = at::randn({32, kD});  // himoe: every group gets rows
  auto first = std::async(std::launch::async, [&] { return Route(0, x); });
  while (stalling.calls.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  {  // queued behind `first`, which holds the batcher until group 3's deadline
    v1::RouteForwardRequest request;
    request.set_layer(0);
    ASSERT_TRUE(EncodeTensor(x, request.mutable_hidden()).ok());
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    v1::RouteForwardResponse response;
    EXPECT_EQ(stub_->RouteForward(&context, request, &response).error_code(),
              grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  EXPECT_EQ(first.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  // The batcher serves in order: once a later request reached group 3, the
  // expired one was dealt with, and it never got there.
  EXPECT_EQ(Route(0, x).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(stalling.calls.load(), 2);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(3));
}

TEST_F(RouterServiceTest, MetricsCountAssignmentsAndExportTheCoreCv) {
  auto registry = std::make_shared<prometheus::Registry>();
  // The binaries' endpoint (its civetweb threads fit beside a LibTorch of
  // much static TLS, as pip's CUDA one), not a bare prometheus::Exposer.
  auto exposer = StartMetricsEndpoint("metrics_port", "127.0.0.1", 0);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  (*exposer)->RegisterCollectable(registry);
  RouterServerOptions o = Options(RoutingMethod::kVanilla);  // flat: uneven groups
  o.registry = registry.get();
  StartRouter(o);
  const at::Tensor x = at::randn({40, kD});
  ASSERT_TRUE(Route(1, x).ok());
  const MoEOutput want = Reference(o.moe.routing, 1, x);
  auto body = testutil::HttpGet(
      "http://127.0.0.1:" + std::to_string(MetricsPort(**exposer)) + "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  double total = 0;
  for (int e = 0; e < kN; ++e) {
    const std::string labels = "expert=\"" + std::to_string(e) + "\",group=\"" +
                               std::to_string(e / 2) + "\",layer=\"1\"";
    auto v = testutil::ScrapeValue(*body, "himoe_router_tokens_total", labels);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(*v, want.routing.stats.expert_counts[e]) << "expert " << e;
    total += *v;
  }
  EXPECT_EQ(total, 40.0 * o.moe.routing.total_k());
  auto cv = testutil::ScrapeValue(*body, "himoe_router_expert_cv", "layer=\"1\"");
  ASSERT_TRUE(cv.ok());
  EXPECT_NEAR(*cv, want.routing.stats.expert_cv, 1e-9);
  EXPECT_GT(*cv, 0.0);
  auto gcv = testutil::ScrapeValue(*body, "himoe_router_group_cv", "layer=\"1\"");
  ASSERT_TRUE(gcv.ok());
  EXPECT_NEAR(*gcv, want.routing.stats.group_cv, 1e-9);
  auto gpt = testutil::ScrapeValue(*body, "himoe_router_groups_per_token", "layer=\"1\"");
  ASSERT_TRUE(gpt.ok());
  EXPECT_NEAR(*gpt, want.routing.stats.groups_per_token, 1e-9);
  auto requests = testutil::ScrapeValue(*body, "himoe_router_request_duration_seconds_count", "");
  ASSERT_TRUE(requests.ok());
  EXPECT_EQ(*requests, 1.0);
  // Every error code is exported at zero before the first error.
  for (const char* code : {"INVALID_ARGUMENT", "UNAVAILABLE", "UNAUTHENTICATED"}) {
    auto zero = testutil::ScrapeValue(*body, "himoe_router_errors_total",
                                      std::string("code=\"") + code + "\"");
    ASSERT_TRUE(zero.ok()) << code << ": " << zero.status();
    EXPECT_EQ(*zero, 0.0) << code;
  }
  // A rejected request is counted by code.
  ASSERT_FALSE(Route(9, x).ok());
  body = testutil::HttpGet(
      "http://127.0.0.1:" + std::to_string(MetricsPort(**exposer)) + "/metrics");
  auto errors = testutil::ScrapeValue(*body, "himoe_router_errors_total", "code=\"INVALID_ARGUMENT\"");
  ASSERT_TRUE(errors.ok()) << errors.status();
  EXPECT_EQ(*errors, 1.0);
}

}  // namespace
}  // namespace himoe::router
