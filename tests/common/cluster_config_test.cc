#include "common/cluster_config.h"

#include <cmath>
#include <limits>
#include <string>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/message_differencer.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace himoe {
namespace {

using ::testing::HasSubstr;

constexpr char kTwoGroups[] = R"pb(
  model { d_model: 8 d_ff: 16 num_experts: 4 }
  groups { address: "127.0.0.1:1" }
  groups { address: "127.0.0.1:2" }
)pb";

TEST(ClusterConfigTest, FillsTheDocumentedDefaults) {
  auto c = ParseClusterConfig(kTwoGroups, "test");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model().num_layers(), 1);
  EXPECT_EQ(c->model().top_k(), 1);
  EXPECT_EQ(c->model().num_groups(), 2);
  EXPECT_EQ(c->model().expert_dtype(), "float32");
  EXPECT_EQ(c->model().matmul_dtype(), "float32");
  EXPECT_EQ(c->routing().method(), "himoe");
  EXPECT_EQ(c->routing().preset(), "paper");
  EXPECT_EQ(c->router().wire_dtype(), "float32");
  EXPECT_EQ(c->router().chunk_bytes(), 4 << 20);
  EXPECT_EQ(c->router().deadline_ms(), 10000);
  EXPECT_EQ(c->router().max_batch_tokens(), 8192);
  EXPECT_EQ(c->router().max_queue_delay_us(), 500);
  EXPECT_EQ(c->router().max_queue_requests(), 4096);
  EXPECT_EQ(c->router().max_batches_in_flight(), 2);
  EXPECT_EQ(c->router().max_tokens_per_request(), 65536);
  EXPECT_FALSE(c->router().shared_memory());
  EXPECT_EQ(c->router().keepalive_ms(), 2000);
  auto off = ParseClusterConfig(absl::StrCat(kTwoGroups, "router { keepalive_ms: 0 }"), "test");
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->router().keepalive_ms(), 0);  // 0 is off, not the default
  // Groups on this host may take the rows through shared memory.
  auto shared = ParseClusterConfig(
      absl::StrCat(kTwoGroups, "router { shared_memory: true }"), "test");
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_TRUE(shared->router().shared_memory());
}

TEST(ClusterConfigTest, EachBadFieldIsNamedWithTheFile) {
  const struct {
    const char* text;
    const char* message;
  } cases[] = {
      {"model { d_model: 8 d_ff: 16 num_experts: 4 } ", "at least one group"},
      {"model { d_model: 0 d_ff: 16 num_experts: 2 } groups { address: \"h:1\" }",
       "model.d_model must be >= 1"},
      {"model { d_model: 8 d_ff: 16 num_experts: 3 } groups { address: \"h:1\" } "
       "groups { address: \"h:2\" }",
       "model.num_experts (3) must be divisible by the number of groups (2)"},
      {"model { d_model: 8 d_ff: 16 num_experts: 2 num_groups: 3 } groups { address: \"h:1\" }",
       "model.num_groups is 3 but 1 groups are listed"},
      {"model { d_model: 8 d_ff: 16 num_experts: 2 } groups { address: \"nohost\" }",
       "groups[0].address must be host:port, got 'nohost'"},
      {"model { d_model: 8 d_ff: 16 num_experts: 2 expert_dtype: \"fp8\" } "
       "groups { address: \"h:1\" }",
       "model.expert_dtype must be float32 or bfloat16, got 'fp8'"},
      {"model { d_model: 8 d_ff: 16 num_experts: 2 matmul_dtype: \"fp8\" } "
       "groups { address: \"h:1\" }",
       "model.matmul_dtype must be float32 or bfloat16, got 'fp8'"},
      {"model { d_model: 8 d_ff: 16 num_experts: 2 } groups { address: \"h:1\" } "
       "router { max_batches_in_flight: -1 }",
       "max_batches_in_flight must be >= 1"},
      {"model { d_model: 8 d_ff: 16 num_experts: 2 } groups { address: \"h:1\" } "
       "router { keepalive_ms: -5 }",
       "router.keepalive_ms must be >= 0 (0 = off), got -5"},
      {"model { d_model: 8 d_ff: 16 num_experts: 2 } groups { address: \"h:1\" } "
       "tls { ca: \"ca.pem\" }",
       "tls: ca, cert and key are all needed"},
      {"model { d_model: 8 d_ff: 16 num_experts: 2 } groups { address: \"10.0.0.5:1\" } "
       "router { shared_memory: true }",
       "router.shared_memory needs every group on this host; groups[0].address is 10.0.0.5:1"},
      {"model { d_model: 8 d_ff: 16 num_experts: 2 } "
       "groups { address: \"127.0.0.1:1\" replicas: \"h:2\" } router { shared_memory: true }",
       "groups[0].replicas[0] is h:2"},
      {"model { d_model: 8 } bogus: 1", "not a valid ClusterConfig text proto: line 1:"},
  };
  for (const auto& c : cases) {
    auto config = ParseClusterConfig(c.text, "cluster.textproto");
    ASSERT_FALSE(config.ok()) << c.text;
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(config.status().message()), HasSubstr("cluster.textproto: "));
    EXPECT_THAT(std::string(config.status().message()), HasSubstr(c.message)) << c.text;
  }
}

// A nan or inf routing setting is refused at parse time, for every double
// field of RoutingSpec (found by cluster_config_fuzzer: `temperature: nan`
// parsed, and a nan never equals itself after printing and parsing back).
TEST(ClusterConfigTest, NonFiniteRoutingSettingsAreRefused) {
  const google::protobuf::Descriptor& routing = *v1::RoutingSpec::descriptor();
  int doubles = 0;
  for (int i = 0; i < routing.field_count(); ++i) {
    const google::protobuf::FieldDescriptor& field = *routing.field(i);
    if (field.cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_DOUBLE) continue;
    ++doubles;
    for (const char* value : {"nan", "inf", "-inf"}) {
      const std::string text =
          absl::StrCat(kTwoGroups, "routing { ", field.name(), ": ", value, " }");
      auto c = ParseClusterConfig(text, "test");
      ASSERT_FALSE(c.ok()) << field.name() << " " << value;
      EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(c.status().message()),
                  HasSubstr(absl::StrCat("routing.", field.name(), " must be a finite number")));
    }
    // A finite value is the range checks' business (RoutingConfig), not the parser's.
    auto finite = ParseClusterConfig(
        absl::StrCat(kTwoGroups, "routing { ", field.name(), ": -0.25 }"), "test");
    EXPECT_TRUE(finite.ok()) << field.name() << ": " << finite.status();
  }
  EXPECT_EQ(doubles, 13);  // temperature .. dual_rate in cluster.proto
}

TEST(ClusterConfigTest, AnAcceptedConfigPrintsAndParsesBackToItself) {
  const std::string text = absl::StrCat(kTwoGroups, R"pb(
    routing { method: "moge" temperature: 0.5 tau: 1e-300 lambda_intra: 3 target_expert_cv: 0 }
    router { address: "127.0.0.1:3" wire_dtype: "bfloat16" max_queue_delay_us: 0 }
  )pb");
  auto c = ParseClusterConfig(text, "test");
  ASSERT_TRUE(c.ok()) << c.status();
  std::string printed;
  ASSERT_TRUE(google::protobuf::TextFormat::PrintToString(*c, &printed));
  auto again = ParseClusterConfig(printed, "printed");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*c, *again)) << printed;
  EXPECT_EQ(again->routing().tau(), 1e-300);
  EXPECT_EQ(again->router().max_queue_delay_us(), 500);  // 0 means "the default"
}

TEST(ClusterConfigTest, LocalThreadsAndWhereTheExpertsComputeComeFromTheGroups) {
  auto here = ParseClusterConfig(R"pb(
    model { d_model: 8 d_ff: 16 num_experts: 4 }
    groups { address: "127.0.0.1:1" threads: 3 }
    groups { address: "localhost:2" threads: 5 device: "cpu" }
    router { threads: 2 }
  )pb", "test");
  ASSERT_TRUE(here.ok()) << here.status();
  EXPECT_EQ(LocalServiceThreads(*here), 3 + 5 + 2);
  EXPECT_EQ(ExpertsOffThisHostCpu(*here), "");

  auto gpu = *here;
  gpu.mutable_groups(1)->set_device("cuda:1");
  EXPECT_EQ(LocalServiceThreads(gpu), 10);  // its host threads still count
  EXPECT_EQ(ExpertsOffThisHostCpu(gpu), "group 1 is on cuda:1");

  auto remote = *here;
  remote.mutable_groups(0)->set_address("10.0.0.7:1");
  EXPECT_EQ(LocalServiceThreads(remote), 5 + 2);
  EXPECT_EQ(ExpertsOffThisHostCpu(remote), "group 0 is on another host (10.0.0.7:1)");

  remote.mutable_groups(1)->set_address("[2001:db8::1]:2");
  EXPECT_EQ(LocalServiceThreads(remote), 0);  // no group here: no router either
}

}  // namespace
}  // namespace himoe
