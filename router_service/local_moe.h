#ifndef HIMOE_ROUTER_SERVICE_LOCAL_MOE_H_
#define HIMOE_ROUTER_SERVICE_LOCAL_MOE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "expert_service/expert_group.h"
#include "router_service/router_layer.h"

namespace himoe::router {

struct LocalMoEOptions {
  RoutingConfig routing;
  int64_t d_model = 0;
  int64_t d_ff = 0;
  int layer = 0;
  uint64_t seed = 0;
  c10::Device device = c10::Device(c10::kCPU);
  c10::ScalarType expert_dtype = c10::kFloat;
};

struct MoEOutput {
  at::Tensor output;  // [T, d] float32, autograd
  RoutingOutput routing;
};

// One MoE layer entirely in-process: the router and all M expert groups.
// The reference every distributed path is tested against.
class LocalMoE {
 public:
  static absl::StatusOr<std::unique_ptr<LocalMoE>> Create(
      const LocalMoEOptions& options);

  // y = sum over the kept selected experts of weight * expert(x).
  absl::StatusOr<MoEOutput> Forward(const at::Tensor& x, bool training);

  RouterLayer& router() { return *router_; }
  const expert::ExpertGroup& group(int g) const { return *groups_[g]; }
  int num_groups() const { return static_cast<int>(groups_.size()); }
  // The gate followed by every group's expert parameters.
  std::vector<at::Tensor> parameters() const;

 private:
  LocalMoE() = default;

  std::unique_ptr<RouterLayer> router_;
  std::vector<std::unique_ptr<expert::ExpertGroup>> groups_;
};

// Seed of layer `layer`'s gate, shared by LocalMoE and the router service.
uint64_t RouterSeedFor(uint64_t seed, int layer);

// Builds the options of group g of a LocalMoE, so that a remote expert
// service can construct exactly the same group.
expert::ExpertGroupOptions GroupOptionsFor(const LocalMoEOptions& options,
                                           int group_id);

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_LOCAL_MOE_H_
