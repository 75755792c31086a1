#ifndef HIMOE_TESTS_EXPERT_SERVICE_EXPERT_TEST_UTIL_H_
#define HIMOE_TESTS_EXPERT_SERVICE_EXPERT_TEST_UTIL_H_

#include <memory>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/tensor_codec.h"
#include "expert_service/expert_group.h"
#include "expert_service/expert_service_core.h"

namespace himoe::expert::testing {

// The oracle: the ExpertGroup a service with `core` options holds for
// `layer`, built locally (as router_service/local_moe.cc builds it).
inline std::unique_ptr<ExpertGroup> GroupLike(const ExpertServiceOptions& core, int layer) {
  ExpertGroupOptions g;
  g.group_id = core.group_id;
  g.experts_per_group = core.num_experts / core.num_groups;
  g.d_model = core.d_model;
  g.d_ff = core.d_ff;
  g.layer = layer;
  g.seed = core.seed;
  g.dtype = core.dtype;
  auto group = ExpertGroup::Create(g);
  EXPECT_TRUE(group.ok()) << group.status();
  return group.ok() ? std::move(group).value() : nullptr;
}

inline v1::Tensor Encode(const at::Tensor& t) {
  v1::Tensor proto;
  EXPECT_TRUE(EncodeTensor(t, &proto).ok());
  return proto;
}

inline at::Tensor Decode(const v1::Tensor& proto) {
  auto t = DecodeTensor(proto);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : at::Tensor();
}

inline double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 && b.numel() == 0) return 0;
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

}  // namespace himoe::expert::testing

#endif  // HIMOE_TESTS_EXPERT_SERVICE_EXPERT_TEST_UTIL_H_
