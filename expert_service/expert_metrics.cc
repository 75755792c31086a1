#include "expert_service/expert_metrics.h"

#include <string>

namespace himoe::expert {
namespace {

prometheus::MetricFamily Family(const char* name, const char* help,
                                prometheus::MetricType type) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

prometheus::ClientMetric Value(prometheus::MetricType type, double value,
                               std::vector<prometheus::ClientMetric::Label> labels) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  return m;
}

}  // namespace

ExpertMetrics::ExpertMetrics(ExpertServiceCore* core, const ComputePool* pool)
    : core_(core), pool_(pool),
      compute_seconds_({0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                        1, 2.5, 5}) {
  core_->set_forward_observer([this](double seconds) { compute_seconds_.Observe(seconds); });
}

std::vector<prometheus::MetricFamily> ExpertMetrics::Collect() const {
  using prometheus::MetricType;
  const ExpertServiceCounters c = core_->counters();
  const std::string group = std::to_string(core_->options().group_id);
  std::vector<prometheus::MetricFamily> out;

  auto tokens = Family("himoe_expert_tokens_total", "Rows computed per expert",
                       MetricType::Counter);
  for (size_t layer = 0; layer < c.tokens_per_layer_expert.size(); ++layer) {
    for (size_t s = 0; s < c.tokens_per_layer_expert[layer].size(); ++s) {
      tokens.metric.push_back(Value(
          MetricType::Counter, static_cast<double>(c.tokens_per_layer_expert[layer][s]),
          {{"expert", std::to_string(core_->first_expert() + static_cast<int>(s))},
           {"group", group},
           {"layer", std::to_string(layer)}}));
    }
  }
  out.push_back(std::move(tokens));

  struct Scalar {
    const char* name;
    const char* help;
    MetricType type;
    double value;
  };
  std::vector<Scalar> scalars = {
      {"himoe_expert_forward_requests_total", "Forward calls, failed ones included",
       MetricType::Counter, static_cast<double>(c.forward_requests)},
      {"himoe_expert_forward_failures_total", "Forward calls that returned an error",
       MetricType::Counter, static_cast<double>(c.forward_failures)},
      {"himoe_expert_received_bytes_total", "Tensor payload bytes received by Forward",
       MetricType::Counter, static_cast<double>(c.bytes_in)},
      {"himoe_expert_sent_bytes_total", "Tensor payload bytes returned by Forward",
       MetricType::Counter, static_cast<double>(c.bytes_out)},
      {"himoe_expert_inflight_requests", "Forward calls running now",
       MetricType::Gauge, static_cast<double>(c.in_flight)},
      {"himoe_expert_pending_saved", "Forward states saved for a Backward not come yet",
       MetricType::Gauge, static_cast<double>(c.pending_saved)},
      {"himoe_expert_saved_expired_total", "Saved Forward states dropped by the TTL",
       MetricType::Counter, static_cast<double>(c.saved_expired)},
      {"himoe_expert_last_applied_step", "Step id of the last optimizer update",
       MetricType::Gauge, static_cast<double>(core_->last_applied_step())},
  };
  if (pool_ != nullptr) {
    scalars.push_back({"himoe_expert_compute_queue_depth", "Calls waiting for a compute worker",
                       MetricType::Gauge, static_cast<double>(pool_->queued())});
    scalars.push_back({"himoe_expert_compute_busy_workers", "Compute workers running a call now",
                       MetricType::Gauge, static_cast<double>(pool_->running())});
    scalars.push_back({"himoe_expert_compute_rejected_total",
                       "Calls refused with RESOURCE_EXHAUSTED: the compute queue was full",
                       MetricType::Counter, static_cast<double>(pool_->rejected())});
  }
  for (const Scalar& s : scalars) {
    auto f = Family(s.name, s.help, s.type);
    f.metric.push_back(Value(s.type, s.value, {{"group", group}}));
    out.push_back(std::move(f));
  }

  auto latency = Family("himoe_expert_compute_duration_seconds",
                        "Time to decode, compute and encode one Forward",
                        MetricType::Histogram);
  prometheus::ClientMetric h = compute_seconds_.Collect();
  h.label = {{"group", group}};
  latency.metric.push_back(std::move(h));
  out.push_back(std::move(latency));
  return out;
}

}  // namespace himoe::expert
