// The metrics endpoint in a process whose libraries hold more static TLS than
// civetweb's 100 KiB thread stacks, as a CUDA LibTorch's do (without the
// endpoint's pthread_attr_setstacksize, every binary's endpoint fails there
// with "null context when constructing CivetServer"). This binary links such
// a library (big_tls).

#include <pthread.h>

#include <cstring>
#include <memory>
#include <string>

#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/metrics_endpoint.h"
#include "common/thread_stack.h"
#include "tests/common/big_tls.h"
#include "tests/http_get.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace himoe {
namespace {

using ::testing::HasSubstr;

TEST(MetricsBesideBigTlsTest, TheLibrarysTlsIsCounted) {
  BigTls()[kBigTlsBytes - 1] = 1;
  EXPECT_GE(LoadedTlsBytes(), kBigTlsBytes);
  EXPECT_LT(LoadedTlsBytes(), kBigTlsBytes + 64 * 1024);  // glibc's and the rest
}

TEST(MetricsBesideBigTlsTest, TheEndpointStartsAndAnswers) {
  absl::StatusOr<std::unique_ptr<prometheus::Exposer>> exposer =
      StartMetricsEndpoint("--metrics_port", "127.0.0.1", 0);
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter()
      .Name("himoe_test_events_total")
      .Help("Events seen by the test.")
      .Register(*registry)
      .Add({})
      .Increment(2);
  (*exposer)->RegisterCollectable(registry);
  const absl::StatusOr<std::string> body = testutil::HttpGet(
      absl::StrCat("http://127.0.0.1:", MetricsPort(**exposer), "/metrics"));
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_THAT(*body, HasSubstr("\nhimoe_test_events_total 2\n"));
}

// A thread asking for civetweb's 100 KiB starts, and can use 64 KiB of it
// beside its own copy of the big TLS.
TEST(MetricsBesideBigTlsTest, ASmallStackThreadKeepsItsStack) {
  pthread_attr_t attr;
  ASSERT_EQ(pthread_attr_init(&attr), 0);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, 100 * 1024), 0);
  pthread_t thread;
  const int rc = pthread_create(
      &thread, &attr,
      [](void*) -> void* {
        volatile char local[64 * 1024];
        std::memset(const_cast<char*>(local), 7, sizeof(local));
        BigTls()[0] = local[sizeof(local) - 1];
        return reinterpret_cast<void*>(static_cast<intptr_t>(BigTls()[0] + BigTls()[1]));
      },
      nullptr);
  pthread_attr_destroy(&attr);
  ASSERT_EQ(rc, 0) << std::strerror(rc);
  void* result = nullptr;
  ASSERT_EQ(pthread_join(thread, &result), 0);
  EXPECT_EQ(reinterpret_cast<intptr_t>(result), 7);  // its TLS starts zeroed
}

}  // namespace
}  // namespace himoe
