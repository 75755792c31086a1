// local::ExpertServiceSpec, the one builder of a himoe-expert service
// (LocalExpertCluster, himoe-cluster and himoe-bench start theirs with it).
#include <string>
#include <vector>

#include "deploy/local/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/small_expert_shape.h"

namespace himoe::local {
namespace {

using ::testing::ElementsAre;

v1::ExpertShape Shape() { return test_util::SmallExpertShape(7); }

TEST(ExpertServiceSpecTest, PlainGroupOnLoopback) {
  ExpertProcessOptions o;
  o.shape = Shape();
  o.threads = 2;
  ExpertSite site;
  site.group_id = 1;
  site.log_dir = "/logs";
  const ServiceSpec spec = ExpertServiceSpec("/bin/himoe-expert", o, site);
  EXPECT_THAT(spec.argv,
              ElementsAre("/bin/himoe-expert", "--address=127.0.0.1:0", "--group_id=1",
                          "--num_groups=4", "--num_experts=8", "--num_layers=2", "--d_model=64",
                          "--d_ff=256", "--seed=7", "--dtype=float32", "--device=cpu",
                          "--threads=2", "--port_file=/logs/expert-1.port"));
  EXPECT_EQ(spec.name, "expert group 1");
  EXPECT_EQ(spec.log_path, "/logs/expert-1.log");
  EXPECT_EQ(spec.pid_file, "/logs/expert-1.pid");
  EXPECT_EQ(spec.port_file, "/logs/expert-1.port");
  EXPECT_EQ(spec.address, "");
  EXPECT_EQ(spec.dial_host, "127.0.0.1");
  EXPECT_FALSE(spec.want_metrics_port);
  EXPECT_FALSE(spec.tls.enabled());
  EXPECT_TRUE(static_cast<bool>(spec.probe));
}

TEST(ExpertServiceSpecTest, EveryOptionOnTheCommandLine) {
  ExpertProcessOptions o;
  o.shape = Shape();
  o.shape.set_dtype(v1::DTYPE_BFLOAT16);
  o.shape.set_matmul_dtype(v1::DTYPE_BFLOAT16);
  o.shape.set_init(v1::WEIGHT_INIT_SWITCH);
  o.shape.set_n_layer(4);
  o.device = "cuda:1";
  o.threads = 3;
  o.shared_memory = true;
  o.max_tokens = 100000;
  o.run_state = true;
  o.tls = TlsFiles{"ca.pem", "cert.pem", "key.pem"};
  ExpertSite site;
  site.group_id = 3;
  site.host = "::1";
  site.port = 50054;
  site.address = "[::1]:50054";
  site.dial_host = "::1";
  site.log_dir = "/var/log/himoe";
  site.metrics_port = 9468;
  site.metrics_host = "0.0.0.0";
  const ServiceSpec spec = ExpertServiceSpec("himoe-expert", o, site);
  EXPECT_THAT(
      spec.argv,
      ElementsAre("himoe-expert", "--address=[::1]:50054", "--group_id=3", "--num_groups=4",
                  "--num_experts=8", "--num_layers=2", "--d_model=64", "--d_ff=256", "--seed=7",
                  "--dtype=bfloat16", "--matmul_dtype=bfloat16", "--init=switch", "--n_layer=4",
                  "--device=cuda:1", "--threads=3", "--port_file=/var/log/himoe/expert-3.port",
                  "--metrics_port=9468", "--metrics_address=0.0.0.0", "--shared_memory",
                  "--run_state_file=/var/log/himoe/expert-3.run", "--max_tokens=100000",
                  "--tls_ca=ca.pem", "--tls_cert=cert.pem", "--tls_key=key.pem"));
  EXPECT_EQ(spec.address, "[::1]:50054");
  EXPECT_EQ(spec.dial_host, "::1");
  EXPECT_TRUE(spec.want_metrics_port);
  EXPECT_EQ(spec.tls.ca_file, "ca.pem");
}

TEST(ExpertServiceSpecTest, MetricsPortZeroPicksOne) {
  ExpertProcessOptions o;
  o.shape = Shape();
  ExpertSite site;
  site.log_dir = "d";
  site.metrics_port = 0;
  const ServiceSpec spec = ExpertServiceSpec("e", o, site);
  EXPECT_THAT(std::vector<std::string>(spec.argv.end() - 2, spec.argv.end()),
              ElementsAre("--metrics_port=0", "--metrics_address=127.0.0.1"));
  EXPECT_TRUE(spec.want_metrics_port);
}

}  // namespace
}  // namespace himoe::local
