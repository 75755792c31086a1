// The expert shape the flag and spec tests build on: 8 experts in 4 groups,
// 2 layers, d_model 64, d_ff 256, float32.
#ifndef HIMOE_TESTS_SMALL_EXPERT_SHAPE_H_
#define HIMOE_TESTS_SMALL_EXPERT_SHAPE_H_

#include <cstdint>

#include "himoe/v1/model.pb.h"

namespace himoe::test_util {

inline v1::ExpertShape SmallExpertShape(uint64_t seed) {
  v1::ExpertShape s;
  s.set_num_experts(8);
  s.set_num_groups(4);
  s.set_num_layers(2);
  s.set_d_model(64);
  s.set_d_ff(256);
  s.set_seed(seed);
  s.set_dtype(v1::DTYPE_FLOAT32);
  return s;
}

}  // namespace himoe::test_util

#endif  // HIMOE_TESTS_SMALL_EXPERT_SHAPE_H_
