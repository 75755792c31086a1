// Mutual TLS on the expert service, its client and the router, with
// certificates made by openssl (make_test_certs.sh): the right certificates
// work, and an unknown CA, an expired certificate, a missing client
// certificate and plaintext are refused.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <ATen/ATen.h>

#include "common/tensor_codec.h"
#include "expert_service/expert_access.h"
#include "expert_service/expert_client.h"
#include "expert_service/expert_grpc_service.h"
#include "proto/grpc_status.h"
#include "proto/tls_credentials.h"
#include "router_service/router_grpc_service.h"
#include "router_service/routing/local_moe.h"
#include "tests/router_service/expert_cluster_util.h"
#include "tests/router_service/routing/routing_test_util.h"
#include "tests/temp_dir.h"

namespace himoe::router {
namespace {

using ::testing::HasSubstr;
using testing::kD;
using testing::kK;
using testing::kM;
using testing::kN;

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new test_util::TempDir("himoe_tls_test");
    const std::string command = "bash " + std::string(HIMOE_SOURCE_DIR) +
                                "/tests/router_service/make_test_certs.sh " + dir_->path();
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
  }
  static void TearDownTestSuite() {
    delete dir_;
  }
  static TlsFiles Files(const std::string& ca, const std::string& leaf) {
    return TlsFiles{dir_->Sub(ca + ".pem"), dir_->Sub(leaf + ".pem"), dir_->Sub(leaf + ".key")};
  }

  // An expert service of group `g` with TLS (the server certificate).
  std::unique_ptr<expert::ExpertServer> StartTlsExpert(int g) {
    expert::ExpertServerOptions o;
    o.address = "127.0.0.1:0";
    o.core.shape = testing::Shape();
    o.core.group_id = g;
    o.tls = Files("ca", "server");
    auto server = expert::ExpertServer::Start(o);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? std::move(server).value() : nullptr;
  }

  // Info from group g's service at `port` as a client with `tls`.
  static absl::Status InfoWith(int port, int g, const TlsFiles& tls) {
    expert::ExpertGroupClientOptions o;
    o.group_id = g;
    o.addresses = {testing::Loopback(port)};
    o.deadline = std::chrono::milliseconds(5000);
    o.tls = tls;
    auto client = expert::ExpertGroupClient::Create(o);
    if (!client.ok()) return client.status();
    return (*client)->Info().status();
  }

  static test_util::TempDir* dir_;
};

test_util::TempDir* TlsTest::dir_ = nullptr;

TEST_F(TlsTest, ExpertServesOnlyClientsWithACertificateOfItsCa) {
  auto server = StartTlsExpert(1);
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  EXPECT_TRUE(InfoWith(port, 1, Files("ca", "client")).ok());

  // Plaintext is refused: the port speaks TLS only.
  const absl::Status plaintext = InfoWith(port, 1, TlsFiles{});
  EXPECT_EQ(plaintext.code(), absl::StatusCode::kUnavailable) << plaintext;
  // A client certificate from another CA, or an expired one, is refused.
  EXPECT_EQ(InfoWith(port, 1, Files("ca", "stranger")).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(InfoWith(port, 1, Files("ca", "expired")).code(), absl::StatusCode::kUnavailable);
  // A server the client's CA did not sign is refused by the client.
  EXPECT_EQ(InfoWith(port, 1, Files("other_ca", "stranger")).code(),
            absl::StatusCode::kUnavailable);
  // No client certificate at all: a TLS client with only the CA.
  {
    grpc::SslCredentialsOptions only_ca;
    std::ifstream in(dir_->Sub("ca.pem"));
    only_ca.pem_root_certs.assign(std::istreambuf_iterator<char>(in), {});
    auto stub = v1::ExpertService::NewStub(
        grpc::CreateChannel(testing::Loopback(port), grpc::SslCredentials(only_ca)));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ExpertInfoResponse response;
    EXPECT_EQ(stub->Info(&context, v1::ExpertInfoRequest(), &response).error_code(),
              grpc::StatusCode::UNAVAILABLE);
  }
  // The service still serves the right client afterwards.
  EXPECT_TRUE(InfoWith(port, 1, Files("ca", "client")).ok());
}

TEST_F(TlsTest, BadFilesAreRefusedNamingThem) {
  expert::ExpertServerOptions o;
  o.address = "127.0.0.1:0";
  o.core.shape = testing::Shape();
  o.tls = Files("ca", "server");
  o.tls.key_file.clear();
  auto missing = expert::ExpertServer::Start(o);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("tls key_file: empty"));
  o.tls = Files("ca", "server");
  o.tls.key_file = o.tls.cert_file;  // a certificate where the key should be
  auto swapped = expert::ExpertServer::Start(o);
  ASSERT_FALSE(swapped.ok());
  EXPECT_THAT(std::string(swapped.status().message()),
              HasSubstr("tls key_file: " + o.tls.key_file + " holds no PEM PRIVATE KEY block"));
  o.tls.key_file = dir_->Sub("no_such.key");
  auto unreadable = expert::ExpertServer::Start(o);
  ASSERT_FALSE(unreadable.ok());
  EXPECT_THAT(std::string(unreadable.status().message()), HasSubstr("tls key_file: cannot read"));
}

// The router serves RouteForward over TLS and calls its groups over TLS; its
// output equals LocalMoE's.
TEST_F(TlsTest, RouterOverTlsEndToEnd) {
  std::vector<std::unique_ptr<expert::ExpertServer>> experts;
  for (int g = 0; g < kM; ++g) {
    experts.push_back(StartTlsExpert(g));
    ASSERT_NE(experts.back(), nullptr);
  }
  RouterServerOptions o;
  o.moe.routing = testing::Config(RoutingMethod::kHiMoe, kN, kM, kK);
  o.moe.shape = testing::Shape();
  for (int g = 0; g < kM; ++g) {
    expert::ExpertGroupClientOptions go;
    go.addresses = {testing::Loopback(experts[g]->port())};
    go.deadline = std::chrono::milliseconds(5000);
    go.tls = Files("ca", "client");
    o.moe.groups.push_back(go);
  }
  o.tls = Files("ca", "server");
  auto router = RouterServer::Start(o);
  ASSERT_TRUE(router.ok()) << router.status();
  const at::Tensor x = at::randn({16, kD});
  v1::RouteForwardRequest request;
  ASSERT_TRUE(EncodeTensor(x, request.mutable_hidden()).ok());
  const auto call = [&](const std::shared_ptr<grpc::ChannelCredentials>& credentials,
                        v1::RouteForwardResponse* response) {
    auto stub = v1::RouterService::NewStub(
        grpc::CreateChannel(testing::Loopback((*router)->port()), credentials));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub->RouteForward(&context, request, response);
  };
  auto credentials = MakeChannelCredentials(Files("ca", "client"));
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  v1::RouteForwardResponse response;
  const grpc::Status ok = call(*credentials, &response);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  LocalMoEOptions lo;
  lo.routing = o.moe.routing;
  lo.shape = testing::Shape();
  lo.layer = 0;
  auto moe = LocalMoE::Create(lo);
  ASSERT_TRUE(moe.ok());
  at::NoGradGuard no_grad;
  auto want = (*moe)->Forward(x, /*training=*/false);
  ASSERT_TRUE(want.ok());
  auto got = DecodeTensor(response.output(), "output");
  ASSERT_TRUE(got.ok());
  EXPECT_LE((*got - want->output).abs().max().item<double>(), 1e-5);
  EXPECT_EQ(call(grpc::InsecureChannelCredentials(), &response).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

// Roles from the certificates' SANs (deploy/make_certs.sh): only the
// trainer's certificate trains; the router's serves and loads; any other
// certificate of the CA reads Info only. Refusals are PERMISSION_DENIED
// naming the method, and change nothing.
TEST_F(TlsTest, OnlyTheTrainersCertificateTrains) {
  expert::ExpertAccessOptions access;
  access.tls = true;
  access.trainer_identity = "spiffe://himoe/trainer";
  access.router_identity = "spiffe://himoe/router";
  std::vector<std::string> warnings;
  auto policy = expert::ExpertAccessPolicy(access, &warnings);
  ASSERT_TRUE(policy.ok()) << policy.status();
  expert::ExpertServerOptions o;
  o.address = "127.0.0.1:0";
  o.core.shape = testing::Shape();
  o.core.group_id = 1;
  o.tls = Files("ca", "server");
  o.policy = *policy;
  auto server = expert::ExpertServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  const auto stub = [&](const std::string& leaf) {
    auto credentials = MakeChannelCredentials(Files("ca", leaf));
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    return v1::ExpertService::NewStub(
        grpc::CreateChannel(testing::Loopback((*server)->port()), *credentials));
  };
  const auto context = [] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return c;
  };
  const auto step = [&](v1::ExpertService::Stub& s) {
    v1::ExpertStepRequest request;
    request.set_norm_only(true);
    v1::ExpertStepResponse response;
    return s.Step(context().get(), request, &response);
  };
  const auto begin = [&](v1::ExpertService::Stub& s, const std::string& run) {
    v1::BeginRunRequest request;
    request.set_run_id(run);
    v1::BeginRunResponse response;
    return s.BeginRun(context().get(), request, &response);
  };
  const auto forward = [&](v1::ExpertService::Stub& s, bool save) {
    v1::ExpertForwardRequest request;
    request.set_save_for_backward(save);
    request.set_run_id("run");
    v1::ExpertRows* in = request.add_inputs();
    in->set_expert_id(2);
    EXPECT_TRUE(EncodeTensor(at::randn({2, kD}), in->mutable_rows()).ok());
    v1::ExpertForwardResponse response;
    return s.Forward(context().get(), request, &response);
  };
  const auto info = [&](v1::ExpertService::Stub& s) {
    v1::ExpertInfoResponse response;
    return s.Info(context().get(), v1::ExpertInfoRequest(), &response);
  };
  auto trainer = stub("trainer");
  auto router = stub("router");
  auto other = stub("client");  // the CA's, without a role

  for (auto* s : {router.get(), other.get()}) {
    const grpc::Status refused = step(*s);
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED) << refused.error_message();
    EXPECT_THAT(refused.error_message(), HasSubstr("/himoe.v1.ExpertService/Step: caller ["));
    EXPECT_EQ(begin(*s, "intruder").error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_EQ(forward(*s, /*save=*/true).error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_TRUE(info(*s).ok());
  }
  EXPECT_THAT(step(*router).error_message(), HasSubstr("spiffe://himoe/router"));
  EXPECT_EQ((*server)->core()->Info().run_id, "");
  EXPECT_TRUE(forward(*router, /*save=*/false).ok());
  EXPECT_EQ(forward(*other, /*save=*/false).error_code(), grpc::StatusCode::PERMISSION_DENIED);

  const grpc::Status begun = begin(*trainer, "run");
  ASSERT_TRUE(begun.ok()) << begun.error_message();
  EXPECT_TRUE(forward(*trainer, /*save=*/true).ok());
  EXPECT_TRUE(step(*trainer).ok());
  EXPECT_EQ((*server)->core()->Info().run_id, "run");
  EXPECT_EQ((*server)->core()->pending_saved(), 1);
}

}  // namespace
}  // namespace himoe::router
