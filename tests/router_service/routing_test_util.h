#ifndef HIMOE_TESTS_ROUTER_SERVICE_ROUTING_TEST_UTIL_H_
#define HIMOE_TESTS_ROUTER_SERVICE_ROUTING_TEST_UTIL_H_

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "himoe/v1/model.pb.h"
#include "router_service/router_layer.h"
#include "router_service/routing_config.h"

namespace himoe::router::testing {

using Matrix = std::vector<std::vector<double>>;

// Plain-double softmax: the hand-computed oracle.
inline std::vector<double> Softmax(const std::vector<double>& z) {
  double max = z[0];
  for (double v : z) max = std::max(max, v);
  double sum = 0;
  std::vector<double> out(z.size());
  for (size_t i = 0; i < z.size(); ++i) sum += out[i] = std::exp(z[i] - max);
  for (double& v : out) v /= sum;
  return out;
}

inline at::Tensor ToTensor(const Matrix& m, at::ScalarType type = at::kDouble) {
  at::Tensor t = at::empty({static_cast<int64_t>(m.size()),
                            static_cast<int64_t>(m[0].size())}, at::kDouble);
  for (size_t i = 0; i < m.size(); ++i) {
    for (size_t j = 0; j < m[i].size(); ++j) t[i][j] = m[i][j];
  }
  return t.to(type);
}

template <typename T = int64_t>
std::vector<std::vector<T>> ToNested(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kDouble).contiguous();
  std::vector<std::vector<T>> out(c.size(0));
  for (int64_t i = 0; i < c.size(0); ++i) {
    for (int64_t j = 0; j < c.size(1); ++j) {
      out[i].push_back(static_cast<T>(c[i][j].item<double>()));
    }
  }
  return out;
}

inline RoutingConfig Config(RoutingMethod method, int n, int m, int k) {
  RoutingConfig c;
  c.method = method;
  c.num_experts = n;
  c.num_groups = m;
  c.top_k = k;
  return c;
}

// The experts of a one-layer float32 MoE with N experts in M groups.
inline v1::ExpertShape Shape(int n, int m, int64_t d_model, int64_t d_ff, uint64_t seed) {
  v1::ExpertShape s;
  s.set_num_experts(n);
  s.set_num_groups(m);
  s.set_num_layers(1);
  s.set_d_model(d_model);
  s.set_d_ff(d_ff);
  s.set_seed(seed);
  s.set_dtype(v1::DTYPE_FLOAT32);
  return s;
}

inline std::unique_ptr<RouterLayer> MakeRouter(const RoutingConfig& config,
                                               int64_t d_model = 4,
                                               uint64_t seed = 1) {
  RouterLayerOptions options;
  options.config = config;
  options.d_model = d_model;
  options.seed = seed;
  auto router = RouterLayer::Create(options);
  EXPECT_TRUE(router.ok()) << router.status();
  return std::move(router).value();
}

inline RoutingOutput MustRoute(RouterLayer& router, const at::Tensor& logits,
                               bool training) {
  auto out = router.RouteLogits(logits, training);
  EXPECT_TRUE(out.ok()) << out.status();
  return std::move(out).value();
}

inline constexpr RoutingMethod kAllMethods[] = {
    RoutingMethod::kVanilla, RoutingMethod::kStMoe, RoutingMethod::kLossFree,
    RoutingMethod::kMoge, RoutingMethod::kHiMoe};

inline std::string MethodParamName(
    const ::testing::TestParamInfo<RoutingMethod>& info) {
  return std::string(RoutingMethodName(info.param));
}

}  // namespace himoe::router::testing

#endif  // HIMOE_TESTS_ROUTER_SERVICE_ROUTING_TEST_UTIL_H_
