#include "trainer/run_log.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include <google/protobuf/util/json_util.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "router_service/routing/routing_math.h"

namespace himoe::trainer {
namespace {

// Keys in insertion order; NaN and infinities are written as null.
using Json = nlohmann::ordered_json;

// Measurements keep 6 significant digits: what the plots and readers use,
// at a third of the bytes of full precision.
double Sig6(double v) { return std::isfinite(v) ? std::stod(absl::StrFormat("%.6g", v)) : v; }

std::vector<double> Sig6(std::vector<double> v) {
  for (double& x : v) x = Sig6(x);
  return v;
}

Json LayerJson(const router::RoutingStats& st) {
  return Json{{"expert_counts", Sig6(st.expert_counts)},
              {"group_counts", Sig6(st.group_counts)},
              {"soft_group_load", Sig6(st.soft_group_load)},
              {"expert_cv", Sig6(st.expert_cv)},
              {"group_cv", Sig6(st.group_cv)},
              {"max_vio", Sig6(st.max_vio)},
              {"groups_per_token", Sig6(st.groups_per_token)},
              {"c_ov", Sig6(st.c_ov)},
              {"c_sys", Sig6(st.c_sys)},
              {"cert_lhs", Sig6(st.cert_lhs)},
              {"cert_rhs", Sig6(st.cert_rhs)},
              {"drop_rate", Sig6(st.drop_rate)},
              {"mean_pi_sq", Sig6(st.mean_pi_sq)},
              {"top_share", Sig6(st.top_share)},
              {"group_top_share", Sig6(st.group_top_share)},
              {"load_entropy", Sig6(st.load_entropy)},
              {"balance_bias", Sig6(st.balance_bias)},
              {"balance_multiplier", Sig6(st.balance_multiplier)},
              {"lambda_intra", Sig6(st.lambda_intra)},
              {"lambda_inter", Sig6(st.lambda_inter)}};
}

std::string Duration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds);
  return s >= 60 ? absl::StrFormat("%dm%02ds", s / 60, s % 60) : absl::StrFormat("%ds", s);
}

// Counts summed over steps, per MoE layer.
struct WindowBalance {
  std::vector<std::vector<double>> experts, groups;
  std::vector<double> groups_per_token, mean_pi_sq;
  std::vector<double> bias_min, bias_max;  // of the last step
};

WindowBalance Balance(const std::deque<StepResult>& steps) {
  WindowBalance w;
  for (const StepResult& s : steps) {
    w.experts.resize(s.layers.size());
    w.groups.resize(s.layers.size());
    w.groups_per_token.resize(s.layers.size(), 0.0);
    w.mean_pi_sq.resize(s.layers.size(), 0.0);
    w.bias_min.resize(s.layers.size(), 0.0);
    w.bias_max.resize(s.layers.size(), 0.0);
    for (size_t l = 0; l < s.layers.size(); ++l) {
      const auto& st = s.layers[l];
      w.experts[l].resize(st.expert_counts.size(), 0.0);
      w.groups[l].resize(st.group_counts.size(), 0.0);
      for (size_t e = 0; e < st.expert_counts.size(); ++e) w.experts[l][e] += st.expert_counts[e];
      for (size_t g = 0; g < st.group_counts.size(); ++g) w.groups[l][g] += st.group_counts[g];
      w.groups_per_token[l] += st.groups_per_token / steps.size();
      w.mean_pi_sq[l] += st.mean_pi_sq / steps.size();
      if (!st.balance_bias.empty()) {
        w.bias_min[l] = *std::min_element(st.balance_bias.begin(), st.balance_bias.end());
        w.bias_max[l] = *std::max_element(st.balance_bias.begin(), st.balance_bias.end());
      }
    }
  }
  return w;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RunLog>> RunLog::Create(const std::string& path,
                                                       int64_t total_steps, int window,
                                                       std::optional<int64_t> resumed_at) {
  if (resumed_at.has_value()) {
    std::string kept;
    std::ifstream in(path, std::ios::binary);
    for (std::string line; std::getline(in, line);) {
      const Json rec = Json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (rec.is_object() && rec.contains("step") && rec["step"].is_number_integer()) {
        const std::string kind = rec.value("kind", "");
        const int64_t step = rec["step"].get<int64_t>();
        if ((kind == "train" && step > *resumed_at) || (kind == "eval" && step >= *resumed_at)) {
          continue;
        }
      }
      absl::StrAppend(&kept, line, "\n");
    }
    // Written aside, then renamed: a crash here leaves the old file whole.
    const std::string aside = path + ".resume";
    {
      std::ofstream out(aside, std::ios::binary | std::ios::trunc);
      out << kept;
      if (!out.flush()) return absl::UnavailableError(absl::StrCat("cannot write ", aside));
    }
    if (absl::Status s = RenamePath(aside, path); !s.ok()) {
      return absl::UnavailableError(absl::StrCat("cannot replace ", path, ": ", s.message()));
    }
  }
  std::ofstream out(path, resumed_at.has_value() ? std::ios::app : std::ios::trunc);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  return std::unique_ptr<RunLog>(
      new RunLog(std::move(out), total_steps, window, resumed_at.has_value()));
}

void RunLog::WriteLine(const std::string& json) {
  out_ << json << "\n";
  out_.flush();
}

void RunLog::OnConfig(const v1::RunConfig& config) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string settings;
  if (!google::protobuf::util::MessageToJsonString(config, &settings, options).ok()) return;
  Json line = {{"kind", resumed_ ? "resume" : "config"}};
  line.update(Json::parse(settings));
  WriteLine(line.dump());
}

void RunLog::OnStep(const StepResult& s) {
  seconds_ += s.seconds;
  tokens_ += s.tokens;
  flops_ += s.flops;
  ++steps_seen_;
  recent_.push_back(s);
  while (static_cast<int>(recent_.size()) > window_) recent_.pop_front();
  Json layers = Json::array();
  for (const auto& st : s.layers) layers.push_back(LayerJson(st));
  Json line = {{"kind", "train"},
                     {"step", s.step},
                     {"lr", Sig6(s.lr)},
                     {"loss", Sig6(s.loss)},
                     {"task", Sig6(s.task)},
                     {"ppl", Sig6(std::exp(s.task))},
                     {"load", Sig6(s.load)},
                     {"intra", Sig6(s.intra)},
                     {"inter", Sig6(s.inter)},
                     {"z", Sig6(s.z)},
                     {"balance", Sig6(s.balance)},
                     {"grad_norm", Sig6(s.grad_norm)},
                     {"tokens", s.tokens},
                     {"seconds", Sig6(s.seconds)},
                     {"tokens_per_s", Sig6(s.tokens / std::max(s.seconds, 1e-9))},
                     {"gflops", Sig6(s.gflops())},
                     {"layers", std::move(layers)}};
  if (s.machine_gflops > 0) line["mfu"] = Sig6(s.mfu());
  if (!s.traffic.empty()) {
    int64_t sent = 0, received = 0;
    for (const RowTraffic& t : s.traffic) {
      sent += t.sent;
      received += t.received;
    }
    line["row_bytes_sent"] = sent;
    line["row_bytes_received"] = received;
  }
  if (s.ranks > 1) {
    line["ranks"] = s.ranks;
    line["allreduce_s"] = Sig6(s.allreduce_seconds);
    line["allreduce_bytes"] = s.allreduce_bytes;
  }
  if (s.waits.calls > 0) {
    line["forward_calls"] = s.waits.calls;
    line["forward_wait_s"] = Sig6(s.waits.slowest_seconds);
    line["forward_straggler_s"] = Sig6(s.waits.straggler_seconds);
  }
  WriteLine(line.dump());
}

void RunLog::OnMemory(int64_t coordinator, const std::vector<int64_t>& experts) {
  const auto mib = [](int64_t bytes) { return Sig6(bytes / 1048576.0); };
  Json per_expert = Json::array();
  for (const int64_t bytes : experts) per_expert.push_back(mib(bytes));
  const Json line = {{"kind", "memory"},
                     {"coordinator_peak_rss_mib", mib(coordinator)},
                     {"expert_peak_rss_mib", std::move(per_expert)}};
  WriteLine(line.dump());
}

std::string RunLog::OnCpu(int64_t steps, double wall_seconds, int cores,
                          double coordinator_seconds,
                          const std::vector<double>& expert_seconds) {
  const auto per_step_ms = [steps](double seconds) { return 1e3 * seconds / steps; };
  const auto ms_text = [&](double seconds) {
    return absl::StrFormat("%.1f", per_step_ms(seconds));
  };
  double used = coordinator_seconds;
  Json per_expert = Json::array();
  for (const double seconds : expert_seconds) {
    per_expert.push_back(Sig6(per_step_ms(seconds)));
    used += seconds;
  }
  const double used_fraction = used / (cores * std::max(wall_seconds, 1e-9));
  const Json line = {{"kind", "cpu"},
                     {"steps", steps},
                     {"wall_s", Sig6(wall_seconds)},
                     {"cores", cores},
                     {"coordinator_core_ms_per_step", Sig6(per_step_ms(coordinator_seconds))},
                     {"expert_core_ms_per_step", std::move(per_expert)},
                     {"used_fraction", Sig6(used_fraction)}};
  WriteLine(line.dump());
  std::string text = absl::StrCat("CPU per step over ", steps, steps == 1 ? " step" : " steps",
                                  ": coordinator ", ms_text(coordinator_seconds), " core-ms");
  if (!expert_seconds.empty()) {
    absl::StrAppend(&text, ", expert processes ",
                    absl::StrJoin(expert_seconds, ", ",
                                  [&](std::string* out, double s) { out->append(ms_text(s)); }),
                    " core-ms");
  }
  absl::StrAppendFormat(&text, "; %.0f%% of %d cores' %s core-ms", 100 * used_fraction, cores,
                        ms_text(cores * wall_seconds));
  return text;
}

void RunLog::OnStop(int64_t step, const std::string& signal, const std::string& checkpoint) {
  const Json line = {
      {"kind", "stop"}, {"step", step}, {"signal", signal}, {"checkpoint", checkpoint}};
  WriteLine(line.dump());
}

void RunLog::OnCompute(const ComputeSetup& c, double flops_per_token) {
  const Json line = {{"kind", "compute"},
                     {"threads", c.threads},
                     {"blas_threads", c.blas_threads},
                     {"blas", c.blas},
                     {"kernels", c.kernels},
                     {"kernels_source", c.kernels_source},
                     {"gemm_gflops", Sig6(c.gemm_gflops)},
                     {"gemm_threads", c.gemm_threads},
                     {"gemm_bf16", c.gemm_bf16},
                     {"vector_peak_gflops", Sig6(c.vector_peak_gflops)},
                     {"flops_per_token", flops_per_token}};
  WriteLine(line.dump());
}

void RunLog::OnEval(int64_t step, const EvalResult& eval) {
  last_val_loss_ = eval.loss;
  Json layers = Json::array();
  for (const auto& st : eval.layers) layers.push_back(LayerJson(st));
  const Json line = {{"kind", "eval"},
                     {"step", step},
                     {"val_loss", Sig6(eval.loss)},
                     {"val_ppl", Sig6(std::exp(eval.loss))},
                     {"layers", std::move(layers)}};
  WriteLine(line.dump());
}

std::string RunLog::ProgressLine() const {
  if (recent_.empty()) return "starting";
  const StepResult& s = recent_.back();
  const double rate = tokens_ / std::max(seconds_, 1e-9);
  const std::string mfu =
      s.machine_gflops > 0
          ? absl::StrFormat(" | MFU %.0f%%", 100 * flops_ / std::max(seconds_, 1e-9) / 1e9 /
                                                  s.machine_gflops)
          : "";
  const double eta = seconds_ / steps_seen_ * (total_steps_ - s.step);
  double cv = 0, top = 0;
  for (const auto& st : s.layers) {
    cv += st.expert_cv / s.layers.size();
    top = std::max(top, st.top_share);
  }
  const std::string val_ppl =
      last_val_loss_ < 0 ? "-" : absl::StrFormat("%.3f", std::exp(last_val_loss_));
  return absl::StrFormat(
      "step %d/%d | loss %.4f (ce %.4f) | val ppl %s | CV %.3f | top share %.2f | %.1fk tok/s%s | "
      "ETA %s",
      s.step, total_steps_, s.loss, s.task, val_ppl, cv, top, rate / 1000, mfu, Duration(eta));
}

std::string RunLog::FinalReport() const {
  const WindowBalance w = Balance(recent_);
  std::string out = absl::StrFormat("Routing balance over the last %d steps:\n", recent_.size());
  absl::StrAppend(&out, absl::StrFormat("%-6s %10s %10s %10s %14s %10s %10s %10s %16s\n",
                                        "layer", "expert CV", "group CV", "MaxVio",
                                        "groups/token", "top share", "load H", "|pi|^2",
                                        "bias range"));
  const int num_groups = recent_.back().layers.empty()
                             ? 1
                             : static_cast<int>(recent_.back().layers[0].group_counts.size());
  for (size_t l = 0; l < w.experts.size(); ++l) {
    double top = 0;
    for (const double share : router::TopExpertShares(w.experts[l], num_groups)) {
      top += share / num_groups;
    }
    absl::StrAppend(
        &out, absl::StrFormat("%-6d %10.4f %10.4f %10.4f %14.3f %10.3f %10.3f %10.3f %16s\n", l,
                              router::CoefficientOfVariation(w.experts[l]),
                              router::CoefficientOfVariation(w.groups[l]),
                              router::MaxViolation(w.experts[l]), w.groups_per_token[l], top,
                              router::NormalizedLoadEntropy(w.experts[l]), w.mean_pi_sq[l],
                              absl::StrFormat("[%+.3f, %+.3f]", w.bias_min[l], w.bias_max[l])));
  }
  return out;
}

}  // namespace himoe::trainer
