#ifndef HIMOE_TESTS_ROUTER_SERVICE_ROUTING_TEST_UTIL_H_
#define HIMOE_TESTS_ROUTER_SERVICE_ROUTING_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "himoe/v1/model.pb.h"
#include "router_service/routing/router_layer.h"
#include "router_service/routing/routing_config.h"

namespace himoe::router::testing {

using Matrix = std::vector<std::vector<double>>;

// Plain-double softmax: the hand-computed oracle.
inline std::vector<double> Softmax(const std::vector<double>& z) {
  double max = z[0];
  for (double v : z) max = std::max(max, v);
  double sum = 0;
  std::vector<double> out(z.size());
  for (size_t i = 0; i < z.size(); ++i) sum += out[i] = std::exp(z[i] - max);
  for (double& v : out) v /= sum;
  return out;
}

inline at::Tensor ToTensor(const Matrix& m, at::ScalarType type = at::kDouble) {
  at::Tensor t = at::empty({static_cast<int64_t>(m.size()),
                            static_cast<int64_t>(m[0].size())}, at::kDouble);
  for (size_t i = 0; i < m.size(); ++i) {
    for (size_t j = 0; j < m[i].size(); ++j) t[i][j] = m[i][j];
  }
  return t.to(type);
}

template <typename T = int64_t>
std::vector<std::vector<T>> ToNested(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kDouble).contiguous();
  std::vector<std::vector<T>> out(c.size(0));
  for (int64_t i = 0; i < c.size(0); ++i) {
    for (int64_t j = 0; j < c.size(1); ++j) {
      out[i].push_back(static_cast<T>(c[i][j].item<double>()));
    }
  }
  return out;
}

inline RoutingConfig Config(RoutingMethod method, int n, int m, int k) {
  RoutingConfig c;
  c.method = method;
  c.num_experts = n;
  c.num_groups = m;
  c.top_k = k;
  return c;
}

// The experts of a one-layer float32 MoE with N experts in M groups.
inline v1::ExpertShape Shape(int n, int m, int64_t d_model, int64_t d_ff, uint64_t seed) {
  v1::ExpertShape s;
  s.set_num_experts(n);
  s.set_num_groups(m);
  s.set_num_layers(1);
  s.set_d_model(d_model);
  s.set_d_ff(d_ff);
  s.set_seed(seed);
  s.set_dtype(v1::DTYPE_FLOAT32);
  return s;
}

inline std::unique_ptr<RouterLayer> MakeRouter(const RoutingConfig& config,
                                               int64_t d_model = 4,
                                               uint64_t seed = 1) {
  RouterLayerOptions options;
  options.config = config;
  options.d_model = d_model;
  options.seed = seed;
  auto router = RouterLayer::Create(options);
  EXPECT_TRUE(router.ok()) << router.status();
  return std::move(router).value();
}

inline RoutingOutput MustRoute(RouterLayer& router, const at::Tensor& logits,
                               bool training) {
  auto out = router.RouteLogits(logits, training);
  EXPECT_TRUE(out.ok()) << out.status();
  return std::move(out).value();
}

inline constexpr RoutingMethod kAllMethods[] = {
    RoutingMethod::kVanilla, RoutingMethod::kStMoe, RoutingMethod::kLossFree,
    RoutingMethod::kMoge, RoutingMethod::kHiMoe};

inline std::string MethodParamName(
    const ::testing::TestParamInfo<RoutingMethod>& info) {
  return std::string(RoutingMethodName(info.param));
}

// ---------------------------------------------------------------------------
// The independent oracle: the spec's routing in plain doubles and loops, from
// the logits alone. Tests compare the code's selection, weights, capacity
// mask, EMA and losses against it; nothing here reads a RoutingOutput.
// ---------------------------------------------------------------------------

using Ids = std::vector<std::vector<int64_t>>;

// The presets as the oracle knows them. HandRoute models the switches
// renormalize, inter_form, intra_source, load_source and capacity_factor;
// the reference preset's other rows (z-loss on the grouped methods, the
// router scale, the released flat load losses, st_moe's random drop,
// loss_free's sigmoid scores, the released capacity rounding) are pinned off
// here and checked one by one, by hand, in reference_preset_test.cc.
inline absl::Status ApplyOraclePreset(const std::string& preset, RoutingConfig* config) {
  const absl::Status status = ApplyPreset(preset, config);
  config->released_z_loss = false;
  config->router_scale = false;
  config->flat_load = FlatLoadForm::kPaper;
  config->second_choice_threshold = 0;
  config->sigmoid_scores = false;
  config->capacity_rounding = CapacityRounding::kCeil;
  return status;
}

// gbar <- beta*gbar + (1-beta)*mean_tokens(g), in doubles.
inline std::vector<double> HandEmaUpdate(const std::vector<double>& ema, const Matrix& logits,
                                         double beta) {
  std::vector<double> out(ema.size());
  for (size_t i = 0; i < ema.size(); ++i) {
    double mean = 0;
    for (const auto& row : logits) mean += row[i];
    mean /= static_cast<double>(logits.size());
    out[i] = beta * ema[i] + (1.0 - beta) * mean;
  }
  return out;
}

// Indices of the `count` largest scores in [begin, end), best first, found by
// repeated linear scans (no sort, no torch).
inline std::vector<int64_t> HandTopIndices(const std::vector<double>& scores, size_t begin,
                                           size_t end, int count) {
  std::vector<bool> taken(scores.size(), false);
  std::vector<int64_t> out;
  for (int n = 0; n < count; ++n) {
    int64_t best = -1;
    for (size_t i = begin; i < end; ++i) {
      if (!taken[i] && (best < 0 || scores[i] > scores[best])) best = static_cast<int64_t>(i);
    }
    taken[best] = true;
    out.push_back(best);
  }
  return out;
}

struct HandRoute {
  Matrix p;       // softmax(g)
  Matrix pi;      // softmax((g - tau*gbar)/T) for himoe, else p
  Matrix scores;  // what selection ranks: pi (himoe), p (+ b for loss_free)
  Ids ids;        // [T][K], per group best first (grouped) or best first (flat)
  Ids rank;       // choice order used for capacity
  Matrix weights; // [T][K]: pi (or p) at ids, renormalized over K if configured
  double load = 0, intra = 0, inter = 0, z = 0;
  double AuxTotal() const { return load + intra + inter + z; }
};

// The spec's selection, weights and losses. `ema` is the gbar that pi uses
// (in training: already updated with this batch); `bias` the loss_free b.
inline HandRoute HandRouting(const RoutingConfig& c, const Matrix& g,
                             const std::vector<double>& ema,
                             const std::vector<double>& bias = {}) {
  const size_t tokens = g.size(), n = g[0].size();
  const size_t s = n / c.num_groups;
  const bool himoe = c.method == RoutingMethod::kHiMoe;
  const bool grouped =
      c.method == RoutingMethod::kHiMoe || c.method == RoutingMethod::kMoge;
  HandRoute r;
  for (const auto& row : g) {
    r.p.push_back(Softmax(row));
    std::vector<double> z(n);
    for (size_t i = 0; i < n; ++i) z[i] = (row[i] - c.tau * ema[i]) / c.temperature;
    r.pi.push_back(himoe ? Softmax(z) : r.p.back());
    std::vector<double> score = r.pi.back();
    if (c.method == RoutingMethod::kLossFree && !bias.empty()) {
      for (size_t i = 0; i < n; ++i) score[i] += bias[i];
    }
    r.scores.push_back(score);
    std::vector<int64_t> ids, rank;
    if (grouped) {
      for (int gi = 0; gi < c.num_groups; ++gi) {
        const auto top = HandTopIndices(score, gi * s, (gi + 1) * s, c.top_k);
        for (int j = 0; j < c.top_k; ++j) ids.push_back(top[j]), rank.push_back(j);
      }
    } else {
      ids = HandTopIndices(score, 0, n, c.num_groups * c.top_k);
      for (size_t j = 0; j < ids.size(); ++j) rank.push_back(static_cast<int64_t>(j));
    }
    double sum = 0;
    for (int64_t id : ids) sum += r.pi.back()[id];
    std::vector<double> w;
    for (int64_t id : ids) w.push_back(r.pi.back()[id] / (c.renormalize ? sum : 1.0));
    r.ids.push_back(ids);
    r.rank.push_back(rank);
    r.weights.push_back(w);
  }
  // Losses, each term straight from the spec's "Losses".
  std::vector<double> h(n, 0.0), big_p(n, 0.0);
  for (size_t t = 0; t < tokens; ++t) {
    for (int64_t id : r.ids[t]) h[id] += 1.0 / tokens;
    const auto& src = c.load_source == ProbSource::kCorrected ? r.pi[t] : r.p[t];
    for (size_t i = 0; i < n; ++i) big_p[i] += src[i] / tokens;
  }
  if (c.method != RoutingMethod::kLossFree) {
    for (size_t i = 0; i < n; ++i) r.load += c.alpha * n * h[i] * big_p[i];
  }
  for (size_t t = 0; t < tokens; ++t) {
    if (himoe) {
      const auto& src = c.intra_source == ProbSource::kCorrected ? r.pi[t] : r.p[t];
      for (double v : src) r.intra -= c.lambda_intra * v * v / tokens;
      if (c.inter_form == InterForm::kSelectedWeights) {
        for (int64_t id : r.ids[t]) {
          r.inter += c.lambda_inter * r.pi[t][id] * r.pi[t][id] / tokens;
        }
      } else {
        for (int gi = 0; gi < c.num_groups; ++gi) {
          double mass = 0;
          for (size_t i = gi * s; i < (gi + 1) * s; ++i) mass += r.p[t][i];
          r.inter += c.lambda_inter * mass * mass / tokens;
        }
      }
    }
    if (c.method == RoutingMethod::kStMoe) {
      double sum = 0;
      for (double v : g[t]) sum += std::exp(v);
      r.z += c.z_coef * std::log(sum) * std::log(sum) / tokens;
    }
  }
  return r;
}

// The smallest gap between the last selected and the first unselected score
// over all tokens (per group for grouped methods): how far from a tie the
// selection is, so that fp32-vs-double differences cannot flip it.
inline double HandSelectionMargin(const RoutingConfig& c, const HandRoute& r) {
  const size_t n = r.scores[0].size();
  const bool grouped =
      c.method == RoutingMethod::kHiMoe || c.method == RoutingMethod::kMoge;
  const size_t blocks = grouped ? c.num_groups : 1;
  const size_t width = n / blocks;
  const size_t picks = grouped ? c.top_k : c.num_groups * c.top_k;
  double margin = 1e300;
  for (const auto& score : r.scores) {
    for (size_t b = 0; b < blocks; ++b) {
      if (picks == width) continue;  // everything is selected: no tie possible
      std::vector<double> v(score.begin() + b * width, score.begin() + (b + 1) * width);
      std::sort(v.rbegin(), v.rend());
      margin = std::min(margin, v[picks - 1] - v[picks]);
    }
  }
  return margin;
}

// cap = ceil(cf*K*T/N); -1 = dropless.
inline int64_t HandCapacity(double cf, int64_t total_k, int64_t tokens, int64_t experts) {
  if (cf <= 0) return -1;
  return static_cast<int64_t>(std::ceil(cf * total_k * tokens / static_cast<double>(experts)));
}

// The spec's drop rule: assignments ordered by (choice rank, token index),
// then kept while their expert has room. Built as an explicit sorted list.
inline Ids HandKeepMask(const Ids& ids, const Ids& rank, int64_t experts, int64_t cap) {
  Ids kept(ids.size(), std::vector<int64_t>(ids[0].size(), cap < 0 ? 1 : 0));
  if (cap < 0) return kept;
  std::vector<std::tuple<int64_t, size_t, size_t>> order;  // (rank, token, slot)
  for (size_t t = 0; t < ids.size(); ++t) {
    for (size_t j = 0; j < ids[t].size(); ++j) order.emplace_back(rank[t][j], t, j);
  }
  std::sort(order.begin(), order.end());
  std::vector<int64_t> used(experts, 0);
  for (const auto& [r, t, j] : order) {
    if (used[ids[t][j]] < cap) ++used[ids[t][j]], kept[t][j] = 1;
  }
  return kept;
}

inline Matrix ToMatrix(const at::Tensor& t) { return ToNested<double>(t); }

inline std::vector<double> ToVector(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

}  // namespace himoe::router::testing

#endif  // HIMOE_TESTS_ROUTER_SERVICE_ROUTING_TEST_UTIL_H_
