#ifndef HIMOE_TESTS_EXPERT_SERVICE_EXPERT_TEST_UTIL_H_
#define HIMOE_TESTS_EXPERT_SERVICE_EXPERT_TEST_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <memory>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "common/tensor_codec.h"
#include "expert_service/expert_group.h"
#include "expert_service/expert_service_core.h"
#include "himoe/v1/model.pb.h"

namespace himoe::expert::testing {

inline v1::ExpertShape MakeShape(int num_experts, int num_groups, int num_layers,
                                 int64_t d_model, int64_t d_ff, uint64_t seed,
                                 v1::DType dtype = v1::DTYPE_FLOAT32) {
  v1::ExpertShape shape;
  shape.set_num_experts(num_experts);
  shape.set_num_groups(num_groups);
  shape.set_num_layers(num_layers);
  shape.set_d_model(d_model);
  shape.set_d_ff(d_ff);
  shape.set_seed(seed);
  shape.set_dtype(dtype);
  return shape;
}

// The oracle: the ExpertGroup a service with `core` options holds for
// `layer`, built locally (as router_service/local_moe.cc builds it).
inline std::unique_ptr<ExpertGroup> GroupLike(const ExpertServiceOptions& core, int layer) {
  auto group = ExpertGroup::Create(core.shape, core.group_id, layer, c10::Device(c10::kCPU));
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

// Two float32 evaluations of the same sums in another order (one GEMM over an
// expert's concatenated rows against autograd accumulating per entry; another
// BLAS kernel's blocking) differ by a few ulps of the result's magnitude.
inline double SumOrderTolerance(const at::Tensor& want, double ulps = 16) {
  const double scale = want.numel() == 0 ? 0.0 : want.abs().max().item<double>();
  return ulps * 1.1920929e-7 * std::max(1.0, scale);
}

}  // namespace himoe::expert::testing

#endif  // HIMOE_TESTS_EXPERT_SERVICE_EXPERT_TEST_UTIL_H_
