#ifndef HIMOE_TESTS_ROUTER_SERVICE_EXPERT_CLUSTER_UTIL_H_
#define HIMOE_TESTS_ROUTER_SERVICE_EXPERT_CLUSTER_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "expert_service/expert_grpc_service.h"
#include "himoe/v1/model.pb.h"

namespace himoe::router::testing {

// The model the router tests serve: N=8 experts in M=4 groups, k=1, 2 layers.
inline constexpr int kN = 8, kM = 4, kK = 1, kLayers = 2;
inline constexpr int64_t kD = 32, kDff = 64;
inline constexpr uint64_t kSeed = 7;

inline v1::ExpertShape Shape() {
  v1::ExpertShape s;
  s.set_num_experts(kN);
  s.set_num_groups(kM);
  s.set_num_layers(kLayers);
  s.set_d_model(kD);
  s.set_d_ff(kDff);
  s.set_seed(kSeed);
  s.set_dtype(v1::DTYPE_FLOAT32);
  return s;
}

// An in-process himoe-expert serving group `group` of that model (with
// --shared_memory when `shared_memory`).
inline std::unique_ptr<expert::ExpertServer> StartExpert(
    int group, const std::string& address = "127.0.0.1:0", bool shared_memory = false) {
  expert::ExpertServerOptions o;
  o.address = address;
  o.core.shape = Shape();
  o.core.group_id = group;
  o.core.shared_memory = shared_memory;
  auto server = expert::ExpertServer::Start(o);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(server).value() : nullptr;
}

inline std::string Loopback(int port) { return "127.0.0.1:" + std::to_string(port); }

}  // namespace himoe::router::testing

#endif  // HIMOE_TESTS_ROUTER_SERVICE_EXPERT_CLUSTER_UTIL_H_
