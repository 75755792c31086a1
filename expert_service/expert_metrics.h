#ifndef HIMOE_EXPERT_SERVICE_EXPERT_METRICS_H_
#define HIMOE_EXPERT_SERVICE_EXPERT_METRICS_H_

#include <vector>

#include <prometheus/collectable.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>

#include "common/compute_pool.h"
#include "expert_service/expert_service_core.h"

namespace himoe::expert {

// The expert group's Prometheus metrics (docs/operations.md, "Metrics reference"), read from the
// core's counters at scrape time, plus the Forward compute-time histogram.
// Every series carries the group label; experts are bounded by N.
class ExpertMetrics : public prometheus::Collectable {
 public:
  // Installs itself as the core's forward observer. `core` (and `pool`, whose
  // queue it reports when not null) must outlive this.
  explicit ExpertMetrics(ExpertServiceCore* core, const ComputePool* pool = nullptr);

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  ExpertServiceCore* core_;
  const ComputePool* pool_;
  mutable prometheus::Histogram compute_seconds_;
};

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_EXPERT_METRICS_H_
