// Who may call what on an expert service: the policy each deployment gets
// (ExpertAccessPolicy), and the gRPC service refusing what it forbids before
// any core sees the call.
#include "expert_service/expert_access.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/tensor_codec.h"
#include "expert_service/expert_grpc_service.h"
#include "himoe/v1/expert.grpc.pb.h"

namespace himoe::expert {
namespace {

using ::testing::HasSubstr;

const std::vector<std::string> kTraining = {"BeginRun", "Backward", "Step",
                                            "Abort",    "GetState", "SetState"};

Caller With(const std::string& principal) {
  Caller c;
  c.authenticated = true;
  c.principals = {principal};
  return c;
}

std::vector<std::string> Allowed(const AccessPolicy& policy, const Caller& caller) {
  std::vector<std::string> allowed;
  for (const std::string& path : ExpertServiceMethods()) {
    if (policy.Check(path, caller).ok()) allowed.push_back(path.substr(path.rfind('/') + 1));
  }
  return allowed;
}

TEST(ExpertAccessTest, TheServiceMethodsAreTheProtosEight) {
  EXPECT_THAT(ExpertServiceMethods(),
              ::testing::UnorderedElementsAre(
                  "/himoe.v1.ExpertService/Info", "/himoe.v1.ExpertService/Forward",
                  "/himoe.v1.ExpertService/Backward", "/himoe.v1.ExpertService/Step",
                  "/himoe.v1.ExpertService/GetState", "/himoe.v1.ExpertService/SetState",
                  "/himoe.v1.ExpertService/Abort", "/himoe.v1.ExpertService/BeginRun"));
}

TEST(ExpertAccessTest, EachDeploymentGetsItsPolicy) {
  std::vector<std::string> warnings;
  ExpertAccessOptions o;

  o.loopback = true;  // plaintext on 127.0.0.1: this host only
  auto open = ExpertAccessPolicy(o, &warnings);
  ASSERT_TRUE(open.ok()) << open.status();
  EXPECT_EQ(*open, nullptr);
  EXPECT_TRUE(warnings.empty());

  o.loopback = false;  // plaintext on 0.0.0.0 or a host's address
  auto serving = ExpertAccessPolicy(o, &warnings);
  ASSERT_TRUE(serving.ok()) << serving.status();
  ASSERT_NE(*serving, nullptr);
  EXPECT_THAT(Allowed(**serving, Caller()), ::testing::ElementsAre("Info", "Forward"));
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("--insecure_training"));

  warnings.clear();
  o.insecure_training = true;
  auto insecure = ExpertAccessPolicy(o, &warnings);
  ASSERT_TRUE(insecure.ok());
  EXPECT_EQ(*insecure, nullptr);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("anyone who reaches this port"));

  warnings.clear();
  o = ExpertAccessOptions();
  o.tls = true;  // mutual TLS, no roles: every certificate of the CA
  auto any_cert = ExpertAccessPolicy(o, &warnings);
  ASSERT_TRUE(any_cert.ok());
  EXPECT_EQ(*any_cert, nullptr);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("--trainer_identity"));

  warnings.clear();
  o.trainer_identity = "spiffe://himoe/trainer";
  o.router_identity = "spiffe://himoe/router";
  auto roles = ExpertAccessPolicy(o, &warnings);
  ASSERT_TRUE(roles.ok()) << roles.status();
  ASSERT_NE(*roles, nullptr);
  EXPECT_TRUE(warnings.empty());
  EXPECT_EQ(Allowed(**roles, With("spiffe://himoe/trainer")).size(), 8u);
  EXPECT_THAT(Allowed(**roles, With("spiffe://himoe/router")),
              ::testing::ElementsAre("Info", "Forward", "SetState"));
  EXPECT_THAT(Allowed(**roles, With("spiffe://himoe/expert")), ::testing::ElementsAre("Info"));
  EXPECT_TRUE(Allowed(**roles, Caller()).empty());
}

TEST(ExpertAccessTest, InconsistentSettingsAreRefusedNamingTheFlag) {
  std::vector<std::string> warnings;
  ExpertAccessOptions o;
  o.trainer_identity = "spiffe://himoe/trainer";
  auto plaintext = ExpertAccessPolicy(o, &warnings);
  EXPECT_EQ(plaintext.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(plaintext.status().message()), HasSubstr("need mutual TLS"));
  o.tls = true;
  o.trainer_identity.clear();
  o.router_identity = "spiffe://himoe/router";
  auto no_trainer = ExpertAccessPolicy(o, &warnings);
  EXPECT_THAT(std::string(no_trainer.status().message()), HasSubstr("--trainer_identity: empty"));
  o.policy_file = "/nonexistent/policy.json";
  auto both = ExpertAccessPolicy(o, &warnings);
  EXPECT_THAT(std::string(both.status().message()), HasSubstr("give one or the other"));
  o.router_identity.clear();
  auto missing = ExpertAccessPolicy(o, &warnings);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("/nonexistent/policy.json"));
}

// A plaintext service on a non-loopback address (its policy, here on
// 127.0.0.1): serving calls are answered, training ones PERMISSION_DENIED
// naming the method, and the weights stay those served.
TEST(ExpertAccessTest, APlaintextServiceOffLoopbackAnswersServingOnly) {
  std::vector<std::string> warnings;
  ExpertAccessOptions access;
  auto policy = ExpertAccessPolicy(access, &warnings);
  ASSERT_TRUE(policy.ok()) << policy.status();
  ExpertServerOptions o;
  o.core.shape.set_num_experts(4);
  o.core.shape.set_num_groups(2);
  o.core.shape.set_num_layers(1);
  o.core.shape.set_d_model(8);
  o.core.shape.set_d_ff(16);
  o.core.shape.set_seed(3);
  o.core.shape.set_dtype(v1::DTYPE_FLOAT32);
  o.policy = *policy;
  auto server = ExpertServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string before = (*server)->core()->Info().weights_fingerprint;
  auto stub = v1::ExpertService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials()));
  auto context = [] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return c;
  };
  v1::ExpertForwardRequest forward;
  v1::ExpertRows* in = forward.add_inputs();
  in->set_expert_id(0);
  ASSERT_TRUE(EncodeTensor(at::randn({3, 8}), in->mutable_rows()).ok());
  v1::ExpertForwardResponse out;
  ASSERT_TRUE(stub->Forward(context().get(), forward, &out).ok());
  EXPECT_EQ(out.weights_fingerprint(), before);
  v1::ExpertInfoResponse info;
  EXPECT_TRUE(stub->Info(context().get(), v1::ExpertInfoRequest(), &info).ok());

  forward.set_save_for_backward(true);
  grpc::Status s = stub->Forward(context().get(), forward, &out);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(), HasSubstr("save_for_backward: a training Forward"));
  v1::BeginRunRequest begin;
  begin.set_run_id("intruder");
  v1::BeginRunResponse begun;
  s = stub->BeginRun(context().get(), begin, &begun);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(s.error_message(),
              HasSubstr("/himoe.v1.ExpertService/BeginRun: an unauthenticated caller"));
  v1::ExpertStepRequest step;
  v1::ExpertStepResponse stepped;
  EXPECT_EQ(stub->Step(context().get(), step, &stepped).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  {
    auto c = context();
    v1::SetStateResponse set;
    auto writer = stub->SetState(c.get(), &set);
    v1::StateChunk chunk;
    chunk.set_name("layer0.w1");
    writer->Write(chunk);
    writer->WritesDone();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    auto c = context();
    auto reader = stub->GetState(c.get(), v1::GetStateRequest());
    v1::StateChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  EXPECT_EQ((*server)->core()->Info().weights_fingerprint, before);
  EXPECT_EQ((*server)->core()->Info().run_id, "");
  forward.set_save_for_backward(false);
  EXPECT_TRUE(stub->Forward(context().get(), forward, &out).ok());
}

}  // namespace
}  // namespace himoe::expert
