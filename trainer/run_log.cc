#include "trainer/run_log.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "router_service/routing_config.h"
#include "router_service/routing_math.h"

namespace himoe::trainer {
namespace {

std::string Num(double v) { return std::isfinite(v) ? absl::StrFormat("%.6g", v) : "null"; }

std::string Array(const std::vector<double>& v) {
  return absl::StrCat("[", absl::StrJoin(v, ",", [](std::string* out, double x) {
                        absl::StrAppend(out, Num(x));
                      }), "]");
}

std::string Duration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds);
  return s >= 60 ? absl::StrFormat("%dm%02ds", s / 60, s % 60) : absl::StrFormat("%ds", s);
}

// Counts summed over steps, per MoE layer.
struct WindowBalance {
  std::vector<std::vector<double>> experts, groups;
  std::vector<double> groups_per_token;
};

WindowBalance Balance(const std::deque<StepResult>& steps) {
  WindowBalance w;
  for (const StepResult& s : steps) {
    w.experts.resize(s.layers.size());
    w.groups.resize(s.layers.size());
    w.groups_per_token.resize(s.layers.size(), 0.0);
    for (size_t l = 0; l < s.layers.size(); ++l) {
      const auto& st = s.layers[l];
      w.experts[l].resize(st.expert_counts.size(), 0.0);
      w.groups[l].resize(st.group_counts.size(), 0.0);
      for (size_t e = 0; e < st.expert_counts.size(); ++e) w.experts[l][e] += st.expert_counts[e];
      for (size_t g = 0; g < st.group_counts.size(); ++g) w.groups[l][g] += st.group_counts[g];
      w.groups_per_token[l] += st.groups_per_token / steps.size();
    }
  }
  return w;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RunLog>> RunLog::Create(const std::string& path,
                                                       int64_t total_steps, int window,
                                                       bool append) {
  std::ofstream out(path, append ? std::ios::app : std::ios::trunc);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  return std::unique_ptr<RunLog>(new RunLog(std::move(out), total_steps, window));
}

void RunLog::OnConfig(const TrainerOptions& o, const std::string& experts) {
  const ModelOptions& m = o.model;
  const router::RoutingConfig& r = m.routing;
  out_ << absl::StrFormat(
              R"({"kind":"config","method":"%s","experts":"%s","n_layer":%d,"d_model":%d,)"
              R"("d_ff":%d,"moe_every":%d,"block_size":%d,"num_experts":%d,"num_groups":%d,)"
              R"("top_k":%d,"temperature":%s,"tau":%s,"ema_beta":%s,"lambda_intra":%s,)"
              R"("lambda_inter":%s,"alpha":%s,"z_coef":%s,"capacity_factor":%s,)"
              R"("renormalize":%s,"steps":%d,"batch_size":%d,"grad_accum":%d,"lr":%s,)"
              R"("seed":%d})",
              router::RoutingMethodName(r.method), experts, m.n_layer, m.d_model, m.d_ff,
              m.moe_every, m.block_size, r.num_experts, r.num_groups, r.top_k,
              Num(r.temperature), Num(r.tau), Num(r.ema_beta), Num(r.lambda_intra),
              Num(r.lambda_inter), Num(r.alpha), Num(r.z_coef), Num(r.capacity_factor),
              r.renormalize ? "true" : "false", o.steps, o.batch_size, o.grad_accum, Num(o.lr),
              o.seed)
       << "\n";
  out_.flush();
}

void RunLog::OnStep(const StepResult& s) {
  seconds_ += s.seconds;
  tokens_ += s.tokens;
  ++steps_seen_;
  recent_.push_back(s);
  while (static_cast<int>(recent_.size()) > window_) recent_.pop_front();
  std::string layers;
  for (const auto& st : s.layers) {
    absl::StrAppend(
        &layers, layers.empty() ? "" : ",",
        absl::StrFormat(
            R"({"expert_counts":%s,"group_counts":%s,"soft_group_load":%s,"expert_cv":%s,)"
            R"("group_cv":%s,"max_vio":%s,"groups_per_token":%s,"c_ov":%s,"c_sys":%s,)"
            R"("cert_lhs":%s,"cert_rhs":%s,"drop_rate":%s})",
            Array(st.expert_counts), Array(st.group_counts), Array(st.soft_group_load),
            Num(st.expert_cv), Num(st.group_cv), Num(st.max_vio), Num(st.groups_per_token),
            Num(st.c_ov), Num(st.c_sys), Num(st.cert_lhs), Num(st.cert_rhs),
            Num(st.drop_rate)));
  }
  out_ << absl::StrFormat(
              R"({"kind":"train","step":%d,"lr":%s,"loss":%s,"task":%s,"ppl":%s,"load":%s,)"
              R"("intra":%s,"inter":%s,"z":%s,"grad_norm":%s,"tokens":%d,"seconds":%s,)"
              R"("tokens_per_s":%s,"layers":[%s]})",
              s.step, Num(s.lr), Num(s.loss), Num(s.task), Num(std::exp(s.task)), Num(s.load),
              Num(s.intra), Num(s.inter), Num(s.z), Num(s.grad_norm), s.tokens, Num(s.seconds),
              Num(s.tokens / std::max(s.seconds, 1e-9)), layers)
       << "\n";
  out_.flush();
}

void RunLog::OnEval(int64_t step, double val_loss) {
  last_val_loss_ = val_loss;
  out_ << absl::StrFormat(R"({"kind":"eval","step":%d,"val_loss":%s,"val_ppl":%s})", step,
                          Num(val_loss), Num(std::exp(val_loss)))
       << "\n";
  out_.flush();
}

std::string RunLog::ProgressLine() const {
  if (recent_.empty()) return "starting";
  const StepResult& s = recent_.back();
  const double rate = tokens_ / std::max(seconds_, 1e-9);
  const double eta = seconds_ / steps_seen_ * (total_steps_ - s.step);
  double cv = 0;
  for (const auto& st : s.layers) cv += st.expert_cv / s.layers.size();
  return absl::StrFormat("step %d/%d | loss %.4f (ce %.4f) | val ppl %s | CV %.3f | %.1fk tok/s | ETA %s",
                         s.step, total_steps_, s.loss, s.task,
                         last_val_loss_ < 0 ? "-" : absl::StrFormat("%.3f", std::exp(last_val_loss_)),
                         cv, rate / 1000, Duration(eta));
}

std::string RunLog::FinalReport() const {
  const WindowBalance w = Balance(recent_);
  std::string out = absl::StrFormat("Routing balance over the last %d steps:\n", recent_.size());
  absl::StrAppend(&out, absl::StrFormat("%-6s %10s %10s %10s %14s\n", "layer", "expert CV",
                                        "group CV", "MaxVio", "groups/token"));
  for (size_t l = 0; l < w.experts.size(); ++l) {
    absl::StrAppend(&out, absl::StrFormat("%-6d %10.4f %10.4f %10.4f %14.3f\n", l,
                                          router::CoefficientOfVariation(w.experts[l]),
                                          router::CoefficientOfVariation(w.groups[l]),
                                          router::MaxViolation(w.experts[l]),
                                          w.groups_per_token[l]));
  }
  return out;
}

}  // namespace himoe::trainer
