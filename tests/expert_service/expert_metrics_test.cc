// The expert group's /metrics, scraped over HTTP after known traffic.
#include "expert_service/expert_metrics.h"

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "common/metrics_endpoint.h"
#include "common/tensor_codec.h"
#include "expert_service/expert_grpc_service.h"
#include "tests/expert_service/expert_test_util.h"
#include "tests/http_get.h"

namespace himoe::expert {
namespace {

TEST(ExpertMetricsTest, CountsRowsBytesAndComputeTimePerExpert) {
  ExpertServerOptions o;
  o.core.group_id = 2;  // of 4 groups of 8 experts: experts 4 and 5
  o.core.shape = testing::MakeShape(/*num_experts=*/8, /*num_groups=*/4, /*num_layers=*/2,
                                    /*d_model=*/8, /*d_ff=*/16, /*seed=*/0);
  auto server = ExpertServer::Start(o);
  ASSERT_TRUE(server.ok()) << server.status();
  auto metrics = std::make_shared<ExpertMetrics>((*server)->core());
  // The binaries' endpoint (its civetweb threads fit beside a LibTorch of
  // much static TLS, as pip's CUDA one), not a bare prometheus::Exposer.
  auto exposer = StartMetricsEndpoint("metrics_port", "127.0.0.1", 0);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  (*exposer)->RegisterCollectable(metrics);

  auto stub = v1::ExpertService::NewStub(
      grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials()));
  // Layer 1: expert 4 gets 3 + 2 rows, expert 5 gets 7; one bad request.
  const int64_t rows[][2] = {{3, 7}, {2, 0}};
  int64_t bytes = 0;
  for (const auto& r : rows) {
    v1::ExpertForwardRequest request;
    request.set_layer(1);
    for (int e = 0; e < 2; ++e) {
      if (r[e] == 0) continue;
      v1::ExpertRows* in = request.add_inputs();
      in->set_expert_id(4 + e);
      ASSERT_TRUE(EncodeTensor(at::randn({r[e], 8}), in->mutable_rows()).ok());
      bytes += r[e] * 8 * 4;
    }
    grpc::ClientContext context;
    v1::ExpertForwardResponse response;
    ASSERT_TRUE(stub->Forward(&context, request, &response).ok());
  }
  {
    v1::ExpertForwardRequest bad;
    bad.set_layer(9);
    grpc::ClientContext context;
    v1::ExpertForwardResponse response;
    ASSERT_FALSE(stub->Forward(&context, bad, &response).ok());
  }

  auto body = testutil::HttpGet(
      "http://127.0.0.1:" + std::to_string(MetricsPort(**exposer)) + "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  const auto value = [&](const std::string& name, const std::string& labels) {
    auto v = testutil::ScrapeValue(*body, name, labels);
    EXPECT_TRUE(v.ok()) << v.status() << "\n" << *body;
    return v.ok() ? *v : -1.0;
  };
  EXPECT_EQ(value("himoe_expert_tokens_total", R"(expert="4",group="2",layer="1")"), 5);
  EXPECT_EQ(value("himoe_expert_tokens_total", R"(expert="5",group="2",layer="1")"), 7);
  EXPECT_EQ(value("himoe_expert_tokens_total", R"(expert="4",group="2",layer="0")"), 0);
  EXPECT_EQ(value("himoe_expert_forward_requests_total", R"(group="2")"), 3);
  EXPECT_EQ(value("himoe_expert_forward_failures_total", R"(group="2")"), 1);
  EXPECT_EQ(value("himoe_expert_received_bytes_total", R"(group="2")"), bytes);
  EXPECT_EQ(value("himoe_expert_sent_bytes_total", R"(group="2")"), bytes);
  EXPECT_EQ(value("himoe_expert_inflight_requests", R"(group="2")"), 0);
  EXPECT_EQ(value("himoe_expert_pending_saved", R"(group="2")"), 0);
  EXPECT_EQ(value("himoe_expert_saved_expired_total", R"(group="2")"), 0);
  EXPECT_EQ(value("himoe_expert_last_applied_step", R"(group="2")"), 0);
  EXPECT_EQ(value("himoe_expert_compute_duration_seconds_count", R"(group="2")"), 3);
  (*server)->Shutdown();
}

}  // namespace
}  // namespace himoe::expert
