#ifndef HIMOE_ROUTER_SERVICE_ROUTING_LOCAL_MOE_H_
#define HIMOE_ROUTER_SERVICE_ROUTING_LOCAL_MOE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "expert_service/expert_group.h"
#include "himoe/v1/model.pb.h"
#include "router_service/routing/router_layer.h"

namespace himoe::router {

struct LocalMoEOptions {
  RoutingConfig routing;
  // N and M must match the routing config's; the layer must be below
  // num_layers. The gate's seed is RouterSeedFor(shape.seed(), layer).
  v1::ExpertShape shape;
  int layer = 0;
  c10::Device device = c10::Device(c10::kCPU);
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

// OK when the experts' N and M are the routing config's; else
// InvalidArgument naming both ("<who>: the experts have N=8, M=4; ...").
absl::Status CheckExpertsMatchRouting(const v1::ExpertShape& shape, const RoutingConfig& routing,
                                      absl::string_view who);

// Seed of layer `layer`'s gate, shared by LocalMoE and the router service.
uint64_t RouterSeedFor(uint64_t seed, int layer);

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_ROUTING_LOCAL_MOE_H_
