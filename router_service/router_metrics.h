#ifndef HIMOE_ROUTER_SERVICE_ROUTER_METRICS_H_
#define HIMOE_ROUTER_SERVICE_ROUTER_METRICS_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "router_service/remote_moe.h"
#include "router_service/routing/router_layer.h"

namespace himoe::router {

struct RouterMetricsOptions {
  int num_layers = 1;
  int num_groups = 1;
  int num_experts = 1;
  int window_batches = 64;  // sliding window of the balance gauges
};

// The router's Prometheus metrics (names in docs/operations.md, "Metrics reference"). Label values
// are bounded: layer x group x expert, and gRPC status codes.
class RouterMetrics : public ForwardObserver {
 public:
  RouterMetrics(const RouterMetricsOptions& options, prometheus::Registry& registry);

  void OnRouted(int layer, const RoutingStats& stats) override;
  void OnGroupDispatch(int group, double seconds, int64_t rows) override;
  void OnWeightsChanged(int group) override;
  void OnExpertsReloaded(int group, bool ok) override;
  void OnRequest(double seconds);
  void OnBatch(int64_t tokens, int64_t requests);
  void OnQueueDepth(int64_t requests);
  // Generate: a stream starts or ends; a token was streamed.
  void OnStream(int delta);
  void OnGeneratedToken();
  void OnError(int grpc_code);

 private:
  struct LayerWindow {
    std::deque<RoutingStats> batches;
  };

  // Per layer and expert: assignments, drops and the window's balance gauges.
  void RegisterBalanceMetrics(prometheus::Registry& r);
  // Per group: dispatch latency and rows; answers from changed weights and
  // reloads.
  void RegisterDispatchMetrics(prometheus::Registry& r);
  // Request latency, batches, queue depth, Generate streams and tokens.
  void RegisterServingMetrics(prometheus::Registry& r);
  // Errors by gRPC status code.
  void RegisterErrorMetrics(prometheus::Registry& r);

  const RouterMetricsOptions options_;
  std::mutex mu_;
  std::vector<LayerWindow> windows_;
  // [layer][expert]
  std::vector<std::vector<prometheus::Counter*>> tokens_;
  std::vector<prometheus::Counter*> dropped_;
  std::vector<prometheus::Gauge*> expert_cv_, group_cv_, max_vio_, groups_per_token_;
  std::vector<prometheus::Histogram*> dispatch_seconds_;
  std::vector<prometheus::Counter*> dispatch_rows_;
  std::vector<prometheus::Counter*> weights_changed_;
  std::vector<prometheus::Counter*> reloads_ok_, reloads_failed_;
  prometheus::Histogram* request_seconds_;
  prometheus::Histogram* batch_tokens_;
  prometheus::Histogram* batch_requests_;
  prometheus::Gauge* queue_depth_;
  prometheus::Gauge* streams_;
  prometheus::Counter* generated_tokens_;
  // By gRPC status code; every code but OK is created at zero, so the series
  // exist before the first error.
  std::vector<prometheus::Counter*> errors_;
};

}  // namespace himoe::router

#endif  // HIMOE_ROUTER_SERVICE_ROUTER_METRICS_H_
