#ifndef HIMOE_TRAINER_TRAINER_METRICS_H_
#define HIMOE_TRAINER_TRAINER_METRICS_H_

#include <string>
#include <utility>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "trainer/trainer.h"

namespace himoe::trainer {

// The trainer's Prometheus metrics (docs/operations.md, "Metrics reference"). Labels are bounded:
// loss kinds, MoE layers x groups x experts, groups x RPC names, and the rank.
class TrainerMetrics {
 public:
  // `rank`: labels every series carries ({rank="r"} for a data-parallel
  // rank; empty for a lone trainer).
  TrainerMetrics(prometheus::Registry& registry, int num_layers, int num_groups, int num_experts,
                 const prometheus::Labels& rank = {});

  void OnStep(const StepResult& step);
  void OnEval(const EvalResult& eval);
  // Thread-safe; called from gRPC threads.
  void OnRpc(int group, const std::string& rpc, double seconds);

 private:
  struct Layer {
    std::vector<prometheus::Counter*> tokens;  // per expert
    prometheus::Gauge *expert_cv, *group_cv, *max_vio, *groups_per_token, *c_ov, *c_sys,
        *cert_lhs, *cert_rhs, *drop_rate, *mean_pi_sq, *load_entropy, *val_expert_cv,
        *balance_multiplier, *lambda_intra, *lambda_inter;
    std::vector<prometheus::Gauge*> top_share;     // per group
    std::vector<prometheus::Gauge*> balance_bias;  // per expert
  };

  int num_groups_;
  prometheus::Family<prometheus::Gauge>& loss_;
  prometheus::Family<prometheus::Histogram>& rpc_;
  std::vector<Layer> layers_;
  prometheus::Gauge *val_loss_, *val_ppl_, *tokens_per_second_, *step_, *lr_, *grad_norm_;
  prometheus::Gauge *model_gflops_, *mfu_, *machine_gflops_;
  prometheus::Histogram* step_seconds_;
  prometheus::Counter* trained_tokens_;
  // Per group: row bytes sent, received.
  std::vector<std::pair<prometheus::Counter*, prometheus::Counter*>> row_bytes_;
};

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_TRAINER_METRICS_H_
