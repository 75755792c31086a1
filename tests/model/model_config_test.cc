// The model's settings as protos: every field survives the round trip the
// checkpoint meta and the run log's config line take; the cluster file's
// routing section; the experts' shape of a model.
#include "model/model_config.h"

#include <google/protobuf/util/message_differencer.h>

#include "absl/status/status.h"
#include "common/cluster_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "router_service/routing/routing_config.h"

namespace himoe::model {
namespace {

using ::testing::HasSubstr;

// Every field away from its default, so that a dropped field shows.
ModelOptions Unusual() {
  ModelOptions o;
  o.vocab_size = 300;
  o.block_size = 96;
  o.n_layer = 6;
  o.n_head = 3;
  o.d_model = 48;
  o.d_ff = 80;
  o.dense_ff = 72;
  o.moe_every = 2;
  o.seed = 1234567890123ull;
  o.expert_dtype = v1::DTYPE_BFLOAT16;
  o.init = v1::WEIGHT_INIT_SWITCH;
  router::RoutingConfig& r = o.routing;
  r.num_experts = 12;
  r.num_groups = 3;
  r.top_k = 2;
  r.method = router::RoutingMethod::kMoge;
  r.temperature = 0.7;
  r.tau = 0.03;
  r.ema_beta = 0.8;
  r.lambda_intra = 0.2;
  r.lambda_inter = 0.06;
  r.alpha = 0.02;
  r.z_coef = 0.002;
  r.capacity_factor = 1.5;
  r.loss_free_rate = 0.004;
  r.renormalize = true;
  r.inter_form = router::InterForm::kDenseGroupMass;
  r.intra_source = router::ProbSource::kRaw;
  r.load_source = router::ProbSource::kRaw;
  return o;
}

TEST(ModelConfigTest, EveryFieldSurvivesTheProtoRoundTrip) {
  const ModelOptions o = Unusual();
  ASSERT_TRUE(ValidateModelOptions(o).ok());
  const v1::ModelConfig proto = ModelConfigToProto(o);
  EXPECT_EQ(proto.routing().method(), "moge");
  EXPECT_EQ(proto.routing().inter_form(), "dense_group_mass");
  EXPECT_EQ(proto.routing().intra_source(), "raw");
  auto back = ModelOptionsFromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(ModelConfigToProto(*back), proto));
  EXPECT_EQ(router::RoutingConfigDebugString(back->routing),
            router::RoutingConfigDebugString(o.routing));
  EXPECT_EQ(back->routing.loss_free_rate, 0.004);
  EXPECT_EQ(back->expert_dtype, v1::DTYPE_BFLOAT16);
  EXPECT_EQ(back->init, v1::WEIGHT_INIT_SWITCH);
}

TEST(ModelConfigTest, UnknownNamesAreRefusedNamingTheField) {
  v1::ModelConfig proto = ModelConfigToProto(Unusual());
  proto.mutable_routing()->set_inter_form("sideways");
  auto bad = ModelOptionsFromProto(proto);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("inter_form"));
  proto = ModelConfigToProto(Unusual());
  proto.mutable_routing()->set_method("magic");
  EXPECT_THAT(std::string(ModelOptionsFromProto(proto).status().message()),
              HasSubstr("'magic' is unknown"));
}

TEST(ModelConfigTest, AnUnsetExpertDtypeReadsAsFloat32) {
  v1::ModelConfig proto = ModelConfigToProto(Unusual());
  proto.clear_expert_dtype();
  auto o = ModelOptionsFromProto(proto);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->expert_dtype, v1::DTYPE_FLOAT32);
}

TEST(ModelConfigTest, ExpertShapeOfAModel) {
  const v1::ExpertShape s = ExpertShapeFor(Unusual());
  EXPECT_EQ(s.num_experts(), 12);
  EXPECT_EQ(s.num_groups(), 3);
  EXPECT_EQ(s.num_layers(), 3);  // 6 layers, MoE on every other one
  EXPECT_EQ(s.d_model(), 48);
  EXPECT_EQ(s.d_ff(), 80);
  EXPECT_EQ(s.seed(), 1234567890123ull);
  EXPECT_EQ(s.dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(s.init(), v1::WEIGHT_INIT_SWITCH);
  EXPECT_EQ(s.n_layer(), 6);  // W2's init std needs the transformer's depth
  // The default init leaves both unset, as shapes written before them.
  ModelOptions plain = Unusual();
  plain.init = v1::WEIGHT_INIT_DEFAULT;
  EXPECT_EQ(ExpertShapeFor(plain).init(), v1::WEIGHT_INIT_DEFAULT);
  EXPECT_EQ(ExpertShapeFor(plain).n_layer(), 0);
}

TEST(ModelConfigTest, TheReferencePresetImpliesTheReleasedInit) {
  EXPECT_EQ(InitForPreset("reference"), v1::WEIGHT_INIT_SWITCH);
  EXPECT_EQ(InitForPreset("paper"), v1::WEIGHT_INIT_DEFAULT);
  ModelOptions o = Unusual();
  o.init = static_cast<v1::WeightInit>(5);
  EXPECT_THAT(std::string(ValidateModelOptions(o).message()), HasSubstr("init"));
}

TEST(ModelConfigTest, TrainingFlopsOfTheReleasedConfig) {
  // 4 layers, d 128, block 128, vocab 256, 8 experts in 4 groups, k 1 per
  // group (K 4), width 512, MoE on every layer. Multiply-adds per token:
  // layer 4*128^2 + 2*128*128 + 128*8 + 4*2*128*512 = 623616; 4 layers
  // 2494464; head 128*256 = 32768; total 2527232; x6 = 15163392.
  ModelOptions o;
  o.n_layer = 4;
  o.d_model = 128;
  o.block_size = 128;
  o.vocab_size = 256;
  o.d_ff = 512;
  o.routing.num_experts = 8;
  o.routing.num_groups = 4;
  o.routing.top_k = 1;
  EXPECT_DOUBLE_EQ(TrainingFlopsPerToken(o), 15163392.0);
  // Every other layer dense (dense_ff 512): layers 0 and 2 swap the router
  // and experts (1024 + 524288) for 2*128*512 = 131072 multiply-adds each.
  o.moe_every = 2;
  o.dense_ff = 512;
  EXPECT_DOUBLE_EQ(TrainingFlopsPerToken(o), 6.0 * (2527232 - 2 * (525312 - 131072)));
}

TEST(ModelConfigTest, RoutingOfAClusterFile) {
  auto cluster = ParseClusterConfig(R"pb(
    model { d_model: 8 d_ff: 8 num_experts: 4 top_k: 2 }
    routing { method: "himoe" preset: "reference" tau: 0.5 capacity_factor: 0 }
    groups { address: "127.0.0.1:1" } groups { address: "127.0.0.1:2" }
  )pb",
                                    "test");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto r = RoutingConfigFromCluster(*cluster);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->num_experts, 4);
  EXPECT_EQ(r->num_groups, 2);
  EXPECT_EQ(r->top_k, 2);
  EXPECT_EQ(r->method, router::RoutingMethod::kHiMoe);
  EXPECT_TRUE(r->renormalize);                  // the reference preset
  EXPECT_EQ(r->inter_form, router::InterForm::kDenseGroupMass);
  EXPECT_EQ(r->tau, 0.5);                       // an explicit override
  EXPECT_EQ(r->capacity_factor, 0.0);           // overrides the preset's 2.0
  cluster->mutable_routing()->set_method("nope");
  EXPECT_EQ(RoutingConfigFromCluster(*cluster).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace himoe::model
