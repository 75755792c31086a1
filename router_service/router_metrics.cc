#include "router_service/router_metrics.h"

#include <string>

#include "absl/status/status.h"
#include "router_service/routing/routing_math.h"

namespace himoe::router {
namespace {

// absl::StatusCode and grpc::StatusCode share 0..16 (UNAUTHENTICATED).
constexpr int kNumStatusCodes = 17;

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
}

prometheus::Histogram::BucketBoundaries PowersOfTwo(double max) {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 1; v <= max; v *= 2) b.push_back(v);
  return b;
}

}  // namespace

RouterMetrics::RouterMetrics(const RouterMetricsOptions& o, prometheus::Registry& r)
    : options_(o), windows_(o.num_layers) {
  RegisterBalanceMetrics(r);
  RegisterDispatchMetrics(r);
  RegisterServingMetrics(r);
  RegisterErrorMetrics(r);
}

void RouterMetrics::RegisterBalanceMetrics(prometheus::Registry& r) {
  const RouterMetricsOptions& o = options_;
  auto& tokens = prometheus::BuildCounter()
                     .Name("himoe_router_tokens_total")
                     .Help("Routed (token, expert) assignments, before capacity drops")
                     .Register(r);
  auto& dropped = prometheus::BuildCounter()
                      .Name("himoe_router_dropped_assignments_total")
                      .Help("Assignments dropped by the expert capacity")
                      .Register(r);
  const auto gauge = [&](const char* name, const char* help) -> auto& {
    return prometheus::BuildGauge().Name(name).Help(help).Register(r);
  };
  auto& expert_cv = gauge("himoe_router_expert_cv",
                          "Expert-load CV (std/mean of token counts) over the sliding window");
  auto& group_cv = gauge("himoe_router_group_cv", "Group-load CV over the sliding window");
  auto& max_vio = gauge("himoe_router_max_violation",
                        "(max - mean)/mean of expert load over the sliding window");
  auto& gpt = gauge("himoe_router_groups_per_token",
                    "Mean distinct groups per token over the sliding window");
  const int s = o.num_experts / o.num_groups;
  for (int l = 0; l < o.num_layers; ++l) {
    const std::string layer = std::to_string(l);
    tokens_.emplace_back();
    for (int e = 0; e < o.num_experts; ++e) {
      tokens_.back().push_back(&tokens.Add(
          {{"layer", layer}, {"group", std::to_string(e / s)}, {"expert", std::to_string(e)}}));
    }
    dropped_.push_back(&dropped.Add({{"layer", layer}}));
    expert_cv_.push_back(&expert_cv.Add({{"layer", layer}}));
    group_cv_.push_back(&group_cv.Add({{"layer", layer}}));
    max_vio_.push_back(&max_vio.Add({{"layer", layer}}));
    groups_per_token_.push_back(&gpt.Add({{"layer", layer}}));
  }
}

void RouterMetrics::RegisterDispatchMetrics(prometheus::Registry& r) {
  auto& dispatch = prometheus::BuildHistogram()
                       .Name("himoe_router_dispatch_duration_seconds")
                       .Help("Time from sending a group's rows to its last answer")
                       .Register(r);
  auto& rows = prometheus::BuildCounter()
                   .Name("himoe_router_dispatched_rows_total")
                   .Help("Rows sent to each expert group")
                   .Register(r);
  auto& changed = prometheus::BuildCounter()
                      .Name("himoe_router_expert_weights_changed_total")
                      .Help(
                          "Group answers refused because the group served other weights than "
                          "the router loaded or checked")
                      .Register(r);
  auto& reloads = prometheus::BuildCounter()
                      .Name("himoe_router_expert_reloads_total")
                      .Help("Pushes of the loaded experts to a group found serving other weights")
                      .Register(r);
  for (int g = 0; g < options_.num_groups; ++g) {
    const std::string group = std::to_string(g);
    dispatch_seconds_.push_back(&dispatch.Add({{"group", group}}, LatencyBuckets()));
    dispatch_rows_.push_back(&rows.Add({{"group", group}}));
    weights_changed_.push_back(&changed.Add({{"group", group}}));
    reloads_ok_.push_back(&reloads.Add({{"group", group}, {"result", "ok"}}));
    reloads_failed_.push_back(&reloads.Add({{"group", group}, {"result", "failed"}}));
  }
}

void RouterMetrics::OnWeightsChanged(int group) {
  if (group >= 0 && group < options_.num_groups) weights_changed_[group]->Increment();
}

void RouterMetrics::OnExpertsReloaded(int group, bool ok) {
  if (group < 0 || group >= options_.num_groups) return;
  (ok ? reloads_ok_ : reloads_failed_)[group]->Increment();
}

void RouterMetrics::RegisterServingMetrics(prometheus::Registry& r) {
  request_seconds_ = &prometheus::BuildHistogram()
                          .Name("himoe_router_request_duration_seconds")
                          .Help("RouteForward latency, queueing included")
                          .Register(r)
                          .Add({}, LatencyBuckets());
  batch_tokens_ = &prometheus::BuildHistogram()
                       .Name("himoe_router_batch_tokens")
                       .Help("Tokens per dynamic batch")
                       .Register(r)
                       .Add({}, PowersOfTwo(65536));
  batch_requests_ = &prometheus::BuildHistogram()
                         .Name("himoe_router_batch_requests")
                         .Help("Requests merged into one dynamic batch")
                         .Register(r)
                         .Add({}, PowersOfTwo(256));
  queue_depth_ = &prometheus::BuildGauge()
                      .Name("himoe_router_queue_depth")
                      .Help("RouteForward and Generate requests waiting in the batch queue")
                      .Register(r)
                      .Add({});
  streams_ = &prometheus::BuildGauge()
                  .Name("himoe_router_generate_streams")
                  .Help("Generate streams running now")
                  .Register(r)
                  .Add({});
  generated_tokens_ = &prometheus::BuildCounter()
                           .Name("himoe_router_generated_tokens_total")
                           .Help("Tokens streamed by Generate (rate / streams = tokens/s per stream)")
                           .Register(r)
                           .Add({});
}

void RouterMetrics::RegisterErrorMetrics(prometheus::Registry& r) {
  auto& errors = prometheus::BuildCounter()
                     .Name("himoe_router_errors_total")
                     .Help("Failed RouteForward calls by gRPC status code")
                     .Register(r);
  errors_.assign(kNumStatusCodes, nullptr);
  for (int code = 1; code < kNumStatusCodes; ++code) {
    errors_[code] = &errors.Add(
        {{"code", absl::StatusCodeToString(static_cast<absl::StatusCode>(code))}});
  }
}

void RouterMetrics::OnRouted(int layer, const RoutingStats& stats) {
  if (layer < 0 || layer >= options_.num_layers) return;
  for (int e = 0; e < options_.num_experts; ++e) {
    tokens_[layer][e]->Increment(stats.expert_counts[e]);
  }
  dropped_[layer]->Increment(static_cast<double>(stats.dropped));
  std::lock_guard<std::mutex> lock(mu_);
  auto& window = windows_[layer].batches;
  window.push_back(stats);
  while (static_cast<int>(window.size()) > options_.window_batches) window.pop_front();
  std::vector<double> experts(options_.num_experts, 0.0), groups(options_.num_groups, 0.0);
  double tokens = 0, group_sum = 0;
  for (const RoutingStats& s : window) {
    for (int e = 0; e < options_.num_experts; ++e) experts[e] += s.expert_counts[e];
    for (int g = 0; g < options_.num_groups; ++g) groups[g] += s.group_counts[g];
    tokens += s.tokens;
    group_sum += s.groups_per_token * s.tokens;
  }
  expert_cv_[layer]->Set(CoefficientOfVariation(experts));
  group_cv_[layer]->Set(CoefficientOfVariation(groups));
  max_vio_[layer]->Set(MaxViolation(experts));
  groups_per_token_[layer]->Set(tokens > 0 ? group_sum / tokens : 0.0);
}

void RouterMetrics::OnGroupDispatch(int group, double seconds, int64_t rows) {
  if (group < 0 || group >= options_.num_groups) return;
  dispatch_seconds_[group]->Observe(seconds);
  dispatch_rows_[group]->Increment(static_cast<double>(rows));
}

void RouterMetrics::OnRequest(double seconds) { request_seconds_->Observe(seconds); }

void RouterMetrics::OnBatch(int64_t tokens, int64_t requests) {
  batch_tokens_->Observe(static_cast<double>(tokens));
  batch_requests_->Observe(static_cast<double>(requests));
}

void RouterMetrics::OnQueueDepth(int64_t requests) {
  queue_depth_->Set(static_cast<double>(requests));
}

void RouterMetrics::OnStream(int delta) { streams_->Increment(delta); }

void RouterMetrics::OnGeneratedToken() { generated_tokens_->Increment(); }

void RouterMetrics::OnError(int grpc_code) {
  constexpr int kUnknown = 2;
  const bool known = grpc_code > 0 && grpc_code < static_cast<int>(errors_.size());
  errors_[known ? grpc_code : kUnknown]->Increment();
}

}  // namespace himoe::router
