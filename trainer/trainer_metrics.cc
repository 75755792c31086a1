#include "trainer/trainer_metrics.h"

#include <cmath>

namespace himoe::trainer {
namespace {

prometheus::Histogram::BucketBoundaries SecondsBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
}

}  // namespace

TrainerMetrics::TrainerMetrics(prometheus::Registry& r, int num_layers, int num_groups,
                               int num_experts, const prometheus::Labels& rank)
    : num_groups_(num_groups),
      loss_(prometheus::BuildGauge()
                .Name("himoe_trainer_loss")
                .Help("Training loss of the last step by kind: task (cross entropy), load, "
                      "intra, inter, z, balance (the balance controller's), total")
                .Labels(rank)
                .Register(r)),
      rpc_(prometheus::BuildHistogram()
               .Name("himoe_trainer_expert_rpc_duration_seconds")
               .Help("Expert-group RPC latency seen by the coordinator")
               .Labels(rank)
               .Register(r)) {
  auto& tokens = prometheus::BuildCounter()
                     .Name("himoe_trainer_tokens_total")
                     .Help("Routed (token, expert) assignments in training")
                     .Labels(rank)
                     .Register(r);
  const auto gauge = [&](const char* name, const char* help) -> auto& {
    return prometheus::BuildGauge().Name(name).Help(help).Labels(rank).Register(r);
  };
  auto& expert_cv = gauge("himoe_trainer_expert_cv", "Expert-load CV of the last step");
  auto& group_cv = gauge("himoe_trainer_group_cv", "Group-load CV of the last step");
  auto& max_vio = gauge("himoe_trainer_max_violation", "MaxVio of the last step");
  auto& gpt = gauge("himoe_trainer_groups_per_token", "Mean distinct groups per token");
  auto& c_ov = gauge("himoe_trainer_routing_overlap", "C_ov = mean(1 - ||pi||^2)");
  auto& c_sys = gauge("himoe_trainer_system_concentration", "C_sys = mean ||pi_tilde||^2");
  auto& lhs = gauge("himoe_trainer_theorem1_lhs", "Theorem 1: CV_group^2 + 1 = M ||rbar||^2");
  auto& rhs = gauge("himoe_trainer_theorem1_rhs",
                    "Theorem 1 bound: M S_max mean ||pi_tilde_normalized||^2");
  auto& drop = gauge("himoe_trainer_drop_rate", "Share of assignments dropped by capacity");
  auto& pi_sq = gauge("himoe_trainer_mean_pi_sq",
                      "Mean ||pi||^2 of the routing distribution (1/N uniform, 1 one-hot)");
  auto& top_share = gauge("himoe_trainer_top_expert_share",
                          "The top expert's share of its group's assignments, last step "
                          "(1/S balanced, 1 collapsed)");
  auto& entropy = gauge("himoe_trainer_load_entropy",
                        "Entropy of the expert load over log N (1 uniform, 0 one expert)");
  auto& bias = gauge("himoe_trainer_balance_bias",
                     "Balance controller's selection bias per expert (logits)");
  auto& multiplier = gauge("himoe_trainer_balance_multiplier",
                           "Balance controller's loss multiplier mu (dual ascent on the gate's CV)");
  auto& lambda = gauge("himoe_trainer_routing_lambda",
                       "R_intra / R_inter weight of the last training batch (term=intra|inter); "
                       "dual variables when epsilon_ov / epsilon_sys are set");
  auto& val_cv = gauge("himoe_trainer_val_expert_cv", "Expert-load CV over the validation set");
  const int s = num_experts / num_groups;
  for (int l = 0; l < num_layers; ++l) {
    const std::string layer = std::to_string(l);
    Layer x;
    for (int e = 0; e < num_experts; ++e) {
      x.tokens.push_back(&tokens.Add(
          {{"layer", layer}, {"group", std::to_string(e / s)}, {"expert", std::to_string(e)}}));
    }
    x.expert_cv = &expert_cv.Add({{"layer", layer}});
    x.group_cv = &group_cv.Add({{"layer", layer}});
    x.max_vio = &max_vio.Add({{"layer", layer}});
    x.groups_per_token = &gpt.Add({{"layer", layer}});
    x.c_ov = &c_ov.Add({{"layer", layer}});
    x.c_sys = &c_sys.Add({{"layer", layer}});
    x.cert_lhs = &lhs.Add({{"layer", layer}});
    x.cert_rhs = &rhs.Add({{"layer", layer}});
    x.drop_rate = &drop.Add({{"layer", layer}});
    x.mean_pi_sq = &pi_sq.Add({{"layer", layer}});
    x.load_entropy = &entropy.Add({{"layer", layer}});
    x.val_expert_cv = &val_cv.Add({{"layer", layer}});
    x.balance_multiplier = &multiplier.Add({{"layer", layer}});
    x.lambda_intra = &lambda.Add({{"layer", layer}, {"term", "intra"}});
    x.lambda_inter = &lambda.Add({{"layer", layer}, {"term", "inter"}});
    for (int g = 0; g < num_groups; ++g) {
      x.top_share.push_back(&top_share.Add({{"layer", layer}, {"group", std::to_string(g)}}));
    }
    for (int e = 0; e < num_experts; ++e) {
      x.balance_bias.push_back(&bias.Add(
          {{"layer", layer}, {"group", std::to_string(e / s)}, {"expert", std::to_string(e)}}));
    }
    layers_.push_back(x);
  }
  val_loss_ = &gauge("himoe_trainer_val_loss", "Validation cross entropy").Add({});
  val_ppl_ = &gauge("himoe_trainer_val_perplexity", "exp(validation cross entropy)").Add({});
  tokens_per_second_ =
      &gauge("himoe_trainer_tokens_per_second", "Training tokens per second, last step").Add({});
  model_gflops_ = &gauge("himoe_trainer_model_gflops",
                         "Model FLOPs per second of the last step, in GFLOP/s "
                         "(TrainingFlopsPerToken x tokens / step time)")
                       .Add({});
  mfu_ = &gauge("himoe_trainer_mfu",
                "Model FLOPs utilisation of the last step: model GFLOP/s over the "
                "machine's GEMM rate (0 when unknown)")
              .Add({});
  machine_gflops_ = &gauge("himoe_trainer_machine_gflops",
                           "The machine's fp32 GEMM rate MFU is measured against, GFLOP/s")
                         .Add({});
  step_ = &gauge("himoe_trainer_step", "Optimizer steps done").Add({});
  lr_ = &gauge("himoe_trainer_learning_rate", "Learning rate of the last step").Add({});
  grad_norm_ = &gauge("himoe_trainer_grad_norm",
                      "Global gradient norm over all shards, before clipping")
                    .Add({});
  step_seconds_ = &prometheus::BuildHistogram()
                       .Name("himoe_trainer_step_duration_seconds")
                       .Help("Wall time of one optimizer step")
                       .Labels(rank)
                       .Register(r)
                       .Add({}, SecondsBuckets());
  trained_tokens_ = &prometheus::BuildCounter()
                         .Name("himoe_trainer_trained_tokens_total")
                         .Help("Tokens trained on")
                         .Labels(rank)
                         .Register(r)
                         .Add({});
  auto& row_bytes = prometheus::BuildCounter()
                        .Name("himoe_trainer_expert_row_bytes_total")
                        .Help(
                            "Bytes of rows, outputs and gradients sent to (direction=\"sent\") "
                            "and received from each expert group by Forward and Backward, as "
                            "the transport moved them (tensor payloads)")
                        .Labels(rank)
                        .Register(r);
  // Create the RPC series up front so dashboards see them before traffic.
  for (int g = 0; g < num_groups; ++g) {
    row_bytes_.push_back(
        {&row_bytes.Add({{"group", std::to_string(g)}, {"direction", "sent"}}),
         &row_bytes.Add({{"group", std::to_string(g)}, {"direction", "received"}})});
    for (const char* rpc : {"Forward", "Backward", "Step"}) {
      rpc_.Add({{"group", std::to_string(g)}, {"rpc", rpc}}, SecondsBuckets());
    }
  }
}

void TrainerMetrics::OnStep(const StepResult& s) {
  const std::pair<const char*, double> kinds[] = {{"task", s.task},   {"load", s.load},
                                                  {"intra", s.intra}, {"inter", s.inter},
                                                  {"z", s.z},         {"balance", s.balance},
                                                  {"total", s.loss}};
  for (const auto& [kind, value] : kinds) loss_.Add({{"kind", kind}}).Set(value);
  for (size_t l = 0; l < s.layers.size() && l < layers_.size(); ++l) {
    const router::RoutingStats& st = s.layers[l];
    Layer& x = layers_[l];
    for (size_t e = 0; e < st.expert_counts.size() && e < x.tokens.size(); ++e) {
      x.tokens[e]->Increment(st.expert_counts[e]);
    }
    x.expert_cv->Set(st.expert_cv);
    x.group_cv->Set(st.group_cv);
    x.max_vio->Set(st.max_vio);
    x.groups_per_token->Set(st.groups_per_token);
    x.c_ov->Set(st.c_ov);
    x.c_sys->Set(st.c_sys);
    x.cert_lhs->Set(st.cert_lhs);
    x.cert_rhs->Set(st.cert_rhs);
    x.drop_rate->Set(st.drop_rate);
    x.mean_pi_sq->Set(st.mean_pi_sq);
    x.load_entropy->Set(st.load_entropy);
    x.balance_multiplier->Set(st.balance_multiplier);
    x.lambda_intra->Set(st.lambda_intra);
    x.lambda_inter->Set(st.lambda_inter);
    for (size_t g = 0; g < st.group_top_share.size() && g < x.top_share.size(); ++g) {
      x.top_share[g]->Set(st.group_top_share[g]);
    }
    for (size_t e = 0; e < st.balance_bias.size() && e < x.balance_bias.size(); ++e) {
      x.balance_bias[e]->Set(st.balance_bias[e]);
    }
  }
  tokens_per_second_->Set(s.tokens / std::max(s.seconds, 1e-9));
  model_gflops_->Set(s.gflops());
  mfu_->Set(s.mfu());
  machine_gflops_->Set(s.machine_gflops);
  step_->Set(static_cast<double>(s.step));
  lr_->Set(s.lr);
  grad_norm_->Set(s.grad_norm);
  step_seconds_->Observe(s.seconds);
  trained_tokens_->Increment(static_cast<double>(s.tokens));
  for (size_t g = 0; g < s.traffic.size() && g < row_bytes_.size(); ++g) {
    row_bytes_[g].first->Increment(static_cast<double>(s.traffic[g].sent));
    row_bytes_[g].second->Increment(static_cast<double>(s.traffic[g].received));
  }
}

void TrainerMetrics::OnEval(const EvalResult& eval) {
  val_loss_->Set(eval.loss);
  val_ppl_->Set(std::exp(eval.loss));
  for (size_t l = 0; l < eval.layers.size() && l < layers_.size(); ++l) {
    layers_[l].val_expert_cv->Set(eval.layers[l].expert_cv);
  }
}

void TrainerMetrics::OnRpc(int group, const std::string& rpc, double seconds) {
  if (group < 0 || group >= num_groups_) return;
  rpc_.Add({{"group", std::to_string(group)}, {"rpc", rpc}}, SecondsBuckets()).Observe(seconds);
}

}  // namespace himoe::trainer
