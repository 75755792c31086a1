// A prometheus-cpp (civetweb) metrics endpoint must start and answer in a
// process that has already loaded LibTorch, its OpenMP pool and the system
// BLAS with the kernels and threads ConfigureCompute chose, as the serving
// binaries do.

#include <limits.h>
#include <link.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/registry.h>
#include <stdlib.h>
#include <ATen/ATen.h>

#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/compute_setup.h"
#include "common/metrics_endpoint.h"
#include "common/thread_stack.h"
#include "common/torch_runtime.h"
#include "tests/http_get.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace himoe {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Multiplies two random 256x256 matrices (through BLAS sgemm) and checks one
// entry against a dot product computed by hand.
void MatmulMatchesManualDotProduct() {
  const at::Tensor a = at::randn({256, 256});
  const at::Tensor b = at::randn({256, 256});
  const at::Tensor c = at::mm(a, b);
  const auto ac = a.accessor<float, 2>();
  const auto bc = b.accessor<float, 2>();
  constexpr int kRow = 17, kCol = 201;
  double expected = 0;
  for (int k = 0; k < 256; ++k) {
    expected += static_cast<double>(ac[kRow][k]) * bc[k][kCol];
  }
  EXPECT_NEAR(c[kRow][kCol].item<float>(), expected, 1e-3);
}

// Canonical paths of every loaded object named libblas.so.3.
std::vector<std::string> LoadedLibblas() {
  std::vector<std::string> paths;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        const std::string name = info->dlpi_name ? info->dlpi_name : "";
        const size_t slash = name.rfind('/');
        if (name.substr(slash == std::string::npos ? 0 : slash + 1) ==
            "libblas.so.3") {
          char resolved[PATH_MAX];
          static_cast<std::vector<std::string>*>(data)->push_back(
              realpath(name.c_str(), resolved) ? resolved : name);
        }
        return 0;
      },
      &paths);
  return paths;
}

class MetricsInTorchProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The set-up every binary runs: kernel probe (child processes), threads,
    // BLAS threads, GEMM rate.
    absl::StatusOr<ComputeSetup> setup = ConfigureCompute(ComputeOptions());
    ASSERT_TRUE(setup.ok()) << setup.status();
    std::cout << setup->Summary() << "; loaded TLS " << LoadedTlsBytes() << " bytes" << std::endl;
    at::manual_seed(7);
    MatmulMatchesManualDotProduct();

    absl::StatusOr<std::unique_ptr<prometheus::Exposer>> exposer =
        StartMetricsEndpoint("--metrics_port", "127.0.0.1", 0);
    ASSERT_TRUE(exposer.ok()) << exposer.status();
    exposer_ = *std::move(exposer);
    const std::vector<int> ports = exposer_->GetListeningPorts();
    ASSERT_EQ(ports.size(), 1u);
    ASSERT_GT(ports[0], 0);
    url_ = absl::StrCat("http://127.0.0.1:", ports[0], "/metrics");

    registry_ = std::make_shared<prometheus::Registry>();
    prometheus::Counter& events = prometheus::BuildCounter()
                                      .Name("himoe_test_events_total")
                                      .Help("Events seen by the test.")
                                      .Register(*registry_)
                                      .Add({});
    for (int i = 0; i < 3; ++i) events.Increment();
    exposer_->RegisterCollectable(registry_);
  }

  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::string url_;
};

TEST_F(MetricsInTorchProcessTest, ServesCounterFromMainThread) {
  const absl::StatusOr<std::string> body = testutil::HttpGet(url_);
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_THAT(*body, HasSubstr("# TYPE himoe_test_events_total counter"));
  EXPECT_THAT(*body, HasSubstr("\nhimoe_test_events_total 3\n"));
}

TEST_F(MetricsInTorchProcessTest, ServesCounterToAnotherThreadRunningTorch) {
  absl::StatusOr<std::string> body = absl::UnknownError("not run");
  std::thread client([&] {
    MatmulMatchesManualDotProduct();
    body = testutil::HttpGet(url_);
  });
  client.join();
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_THAT(*body, HasSubstr("\nhimoe_test_events_total 3\n"));
}

TEST_F(MetricsInTorchProcessTest, UnknownPathIsNotServed) {
  const absl::StatusOr<std::string> body = testutil::HttpGet(absl::StrCat(
      "http://127.0.0.1:", exposer_->GetListeningPorts()[0], "/not_metrics"));
  EXPECT_EQ(body.status().code(), absl::StatusCode::kUnknown) << body.status();
  EXPECT_THAT(body.status().message(), HasSubstr("HTTP 404"));
}

TEST_F(MetricsInTorchProcessTest, SystemBlasIsLoaded) {
  const std::vector<std::string> blas = LoadedLibblas();
  ASSERT_THAT(blas, Not(::testing::IsEmpty()));
  for (const std::string& path : blas) {
    std::cout << "libblas.so.3 resolves to " << path << std::endl;
    RecordProperty("libblas", path);
  }
}

}  // namespace
}  // namespace himoe
