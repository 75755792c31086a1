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
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "himoe/v1/model.pb.h"
#include "router_service/routing/router_layer.h"
#include "router_service/routing/routing_config.h"

namespace himoe::router::testing {

// A parameterized test's (method, preset) and its readable name.
using MethodPreset = std::tuple<RoutingMethod, const char*>;

inline std::string MethodPresetName(const ::testing::TestParamInfo<MethodPreset>& info) {
  return std::string(RoutingMethodName(std::get<0>(info.param))) + "_" + std::get<1>(info.param);
}

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
  Matrix source;  // what the weights are taken from: pi, or sigmoid(g) (loss_free, released)
  Matrix scores;  // what selection ranks: pi (himoe), p or sigmoid(g) (+ b for loss_free)
  Ids ids;        // [T][K], per group best first (grouped) or best first (flat)
  Ids rank;       // choice order used for capacity
  Matrix unscaled;  // [T][K]: source at ids, renormalized over K if configured
  Matrix weights;   // [T][K]: unscaled times the router scale of the pick
  double load = 0, intra = 0, inter = 0, z = 0;
  double AuxTotal() const { return load + intra + inter + z; }
};

inline bool HandGrouped(const RoutingConfig& c) {
  return c.method == RoutingMethod::kHiMoe || c.method == RoutingMethod::kMoge;
}

// Whether the released router scale applies (moge and himoe only).
inline bool HandScaled(const RoutingConfig& c) { return c.router_scale && HandGrouped(c); }

// Whether the z-loss is on: st_moe always; the released configs also set it
// on every method but loss_free.
inline bool HandZLossOn(const RoutingConfig& c) {
  return c.method == RoutingMethod::kStMoe ||
         (c.released_z_loss && c.method != RoutingMethod::kLossFree);
}

inline double HandSigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

// The spec's selection, weights and losses, with every switch of both
// presets (the last table of the spec). `ema` is the gbar that pi uses (in
// training: already updated with this batch); `bias` the loss_free b;
// `scale` the router scale per expert (empty = 1).
inline HandRoute HandRouting(const RoutingConfig& c, const Matrix& g,
                             const std::vector<double>& ema,
                             const std::vector<double>& bias = {},
                             const std::vector<double>& scale = {}) {
  const size_t tokens = g.size(), n = g[0].size();
  const size_t s = n / c.num_groups;
  const bool himoe = c.method == RoutingMethod::kHiMoe;
  const bool grouped = HandGrouped(c);
  const bool sigmoid = c.method == RoutingMethod::kLossFree && c.sigmoid_scores;
  HandRoute r;
  for (const auto& row : g) {
    r.p.push_back(Softmax(row));
    std::vector<double> z(n);
    for (size_t i = 0; i < n; ++i) z[i] = (row[i] - c.tau * ema[i]) / c.temperature;
    r.pi.push_back(himoe ? Softmax(z) : r.p.back());
    std::vector<double> source = r.pi.back();
    if (sigmoid) {
      for (size_t i = 0; i < n; ++i) source[i] = HandSigmoid(row[i]);
    }
    r.source.push_back(source);
    std::vector<double> score = source;
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
    for (int64_t id : ids) sum += source[id];
    std::vector<double> w, scaled;
    for (int64_t id : ids) {
      w.push_back(source[id] / (c.renormalize ? sum : 1.0));
      const double sc = HandScaled(c) && !scale.empty() ? scale[id] : 1.0;
      scaled.push_back(w.back() * sc);
    }
    r.ids.push_back(ids);
    r.rank.push_back(rank);
    r.unscaled.push_back(w);
    r.weights.push_back(scaled);
  }
  // Losses, each term straight from the spec's "Losses" and its last table.
  const double k_total = static_cast<double>(c.num_groups * c.top_k);
  std::vector<double> h(n, 0.0), big_p(n, 0.0);
  const bool released_vanilla =
      c.method == RoutingMethod::kVanilla && c.flat_load == FlatLoadForm::kReleased;
  const bool released_st_moe =
      c.method == RoutingMethod::kStMoe && c.flat_load == FlatLoadForm::kReleased;
  for (size_t t = 0; t < tokens; ++t) {
    if (released_vanilla) {
      // h_i = c_i / (T*K); P_i = selected (renormalized) weights of i / T.
      for (size_t j = 0; j < r.ids[t].size(); ++j) {
        h[r.ids[t][j]] += 1.0 / (tokens * k_total);
        big_p[r.ids[t][j]] += r.unscaled[t][j] / tokens;
      }
      continue;
    }
    if (released_st_moe) {
      h[r.ids[t][0]] += 1.0 / tokens;  // the top-1 choices only
    } else {
      for (int64_t id : r.ids[t]) h[id] += 1.0 / tokens;
    }
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
    if (HandZLossOn(c)) {
      double sum = 0;
      for (double v : g[t]) sum += std::exp(v);
      r.z += c.z_coef * std::log(sum) * std::log(sum) / tokens;
    }
  }
  return r;
}

// f = aux losses + sum_{t,j} coeff[t][j] * weights[t][j]: every path that
// carries a gradient to the logits, the combine weights included.
inline double HandObjective(const RoutingConfig& c, const Matrix& g,
                            const std::vector<double>& ema, const std::vector<double>& bias,
                            const std::vector<double>& scale, const Matrix& coeff) {
  const HandRoute r = HandRouting(c, g, ema, bias, scale);
  double f = r.AuxTotal();
  for (size_t t = 0; t < r.weights.size(); ++t) {
    for (size_t j = 0; j < r.weights[t].size(); ++j) f += coeff[t][j] * r.weights[t][j];
  }
  return f;
}

// d(HandObjective)/d(logits), derived by hand with the selection held fixed
// and gbar constant. Each term gives its partial derivative with respect to
// p, pi or sigmoid(g) (or g itself for the z-loss); a softmax q = softmax(z)
// passes a_q back as dz_j = q_j * (a_q_j - sum_i q_i a_q_i), and pi's logits
// are divided by the temperature.
inline Matrix HandGradient(const RoutingConfig& c, const Matrix& g,
                           const std::vector<double>& ema, const std::vector<double>& bias,
                           const std::vector<double>& scale, const Matrix& coeff) {
  const HandRoute r = HandRouting(c, g, ema, bias, scale);
  const size_t tokens = g.size(), n = g[0].size(), s = n / c.num_groups;
  const double big_t = static_cast<double>(tokens);
  const double k_total = static_cast<double>(c.num_groups * c.top_k);
  const bool himoe = c.method == RoutingMethod::kHiMoe;
  const bool sigmoid = c.method == RoutingMethod::kLossFree && c.sigmoid_scores;
  const bool released_vanilla =
      c.method == RoutingMethod::kVanilla && c.flat_load == FlatLoadForm::kReleased;
  const bool released_st_moe =
      c.method == RoutingMethod::kStMoe && c.flat_load == FlatLoadForm::kReleased;
  // h as the load loss counts it.
  std::vector<double> h(n, 0.0);
  for (size_t t = 0; t < tokens; ++t) {
    if (released_st_moe) {
      h[r.ids[t][0]] += 1.0 / big_t;
    } else {
      for (int64_t id : r.ids[t]) h[id] += 1.0 / (released_vanilla ? big_t * k_total : big_t);
    }
  }
  const bool load_on = c.method != RoutingMethod::kLossFree;
  Matrix grad(tokens, std::vector<double>(n, 0.0));
  for (size_t t = 0; t < tokens; ++t) {
    std::vector<double> a_p(n, 0.0), a_pi(n, 0.0), a_src(n, 0.0);
    // d f / d (final weight j), then through the scale and the renormalization.
    const size_t picks = r.ids[t].size();
    std::vector<double> a_w(picks, 0.0);
    for (size_t j = 0; j < picks; ++j) {
      const double sc = HandScaled(c) && !scale.empty() ? scale[r.ids[t][j]] : 1.0;
      a_w[j] = coeff[t][j] * sc;
      if (load_on && released_vanilla) a_w[j] += c.alpha * n * h[r.ids[t][j]] / big_t;
    }
    double sum = 0, dot = 0;
    for (size_t j = 0; j < picks; ++j) sum += r.source[t][r.ids[t][j]];
    for (size_t j = 0; j < picks; ++j) dot += a_w[j] * r.unscaled[t][j];
    for (size_t j = 0; j < picks; ++j) {
      a_src[r.ids[t][j]] += c.renormalize ? (a_w[j] - dot) / sum : a_w[j];
    }
    // The load loss: alpha * N * sum_i h_i * mean_t src_i.
    if (load_on && !released_vanilla) {
      auto& a = c.load_source == ProbSource::kCorrected ? a_pi : a_p;
      for (size_t i = 0; i < n; ++i) a[i] += c.alpha * n * h[i] / big_t;
    }
    if (himoe) {
      auto& a = c.intra_source == ProbSource::kCorrected ? a_pi : a_p;
      const auto& q = c.intra_source == ProbSource::kCorrected ? r.pi[t] : r.p[t];
      for (size_t i = 0; i < n; ++i) a[i] += -2.0 * c.lambda_intra * q[i] / big_t;
      if (c.inter_form == InterForm::kSelectedWeights) {
        for (int64_t id : r.ids[t]) a_pi[id] += 2.0 * c.lambda_inter * r.pi[t][id] / big_t;
      } else {
        for (int gi = 0; gi < c.num_groups; ++gi) {
          double mass = 0;
          for (size_t i = gi * s; i < (gi + 1) * s; ++i) mass += r.p[t][i];
          for (size_t i = gi * s; i < (gi + 1) * s; ++i) {
            a_p[i] += 2.0 * c.lambda_inter * mass / big_t;
          }
        }
      }
    }
    // The weight source: sigmoid(g), pi (himoe) or p (= pi elsewhere).
    if (sigmoid) {
      for (size_t i = 0; i < n; ++i) {
        const double q = r.source[t][i];
        grad[t][i] += a_src[i] * q * (1.0 - q);
      }
    } else {
      for (size_t i = 0; i < n; ++i) (himoe ? a_pi : a_p)[i] += a_src[i];
    }
    const auto softmax_back = [&](const std::vector<double>& q, const std::vector<double>& a,
                                  double factor) {
      double mean = 0;
      for (size_t i = 0; i < n; ++i) mean += q[i] * a[i];
      for (size_t i = 0; i < n; ++i) grad[t][i] += factor * q[i] * (a[i] - mean);
    };
    softmax_back(r.p[t], a_p, 1.0);
    if (himoe) {
      softmax_back(r.pi[t], a_pi, 1.0 / c.temperature);
    } else {
      softmax_back(r.p[t], a_pi, 1.0);  // pi = p
    }
    if (HandZLossOn(c)) {
      double total = 0;
      for (double v : g[t]) total += std::exp(v);
      const double lse = std::log(total);
      for (size_t i = 0; i < n; ++i) grad[t][i] += 2.0 * c.z_coef * lse * r.p[t][i] / big_t;
    }
  }
  return grad;
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

// The capacity of a batch of `tokens` rows under either rounding: the
// paper's ceil, or the released floor, made even (all methods but
// loss_free), then at least 4.
inline int64_t HandCapacity(const RoutingConfig& c, int64_t tokens) {
  if (c.capacity_rounding == CapacityRounding::kCeil) {
    return HandCapacity(c.capacity_factor, c.total_k(), tokens, c.num_experts);
  }
  if (c.capacity_factor <= 0) return -1;
  int64_t cap = static_cast<int64_t>(
      std::floor(c.capacity_factor * c.total_k() * tokens / static_cast<double>(c.num_experts)));
  if (c.method != RoutingMethod::kLossFree && cap % 2 == 1) ++cap;
  return cap < 4 ? 4 : cap;
}

// The spec's drop rule: assignments ordered by (choice rank, token index),
// then kept while their expert has room. Built as an explicit sorted list.
// An assignment whose `active` entry is 0 (st_moe's random drop) is neither
// kept nor takes room; empty `active` = all active.
inline Ids HandKeepMask(const Ids& ids, const Ids& rank, int64_t experts, int64_t cap,
                        const Ids& active = {}) {
  const auto on = [&](size_t t, size_t j) { return active.empty() || active[t][j] != 0; };
  Ids kept(ids.size(), std::vector<int64_t>(ids[0].size(), 0));
  std::vector<std::tuple<int64_t, size_t, size_t>> order;  // (rank, token, slot)
  for (size_t t = 0; t < ids.size(); ++t) {
    for (size_t j = 0; j < ids[t].size(); ++j) {
      if (on(t, j)) order.emplace_back(rank[t][j], t, j);
    }
  }
  std::sort(order.begin(), order.end());
  std::vector<int64_t> used(experts, 0);
  for (const auto& [r, t, j] : order) {
    if (cap < 0 || used[ids[t][j]] < cap) ++used[ids[t][j]], kept[t][j] = 1;
  }
  return kept;
}

// SplitMix64, the released generator's seed mixer, written out.
inline uint64_t HandSplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// The seed of st_moe's drop draws: call 0 in evaluation, the n-th training
// call (1-based) in training, mixed with the router's seed.
inline uint64_t HandDropSeed(uint64_t router_seed, uint64_t call) {
  return HandSplitMix64(router_seed ^ HandSplitMix64(call));
}

// st_moe's released random drop: a pick of rank >= 1 stays iff its uniform
// draw u < weight / threshold; u comes from a fresh generator seeded with
// `drop_seed`, one double per pick in row-major [T, K] order.
inline Ids HandActiveMask(const Ids& rank, const Matrix& weights, double threshold,
                          uint64_t drop_seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(drop_seed);
  const int64_t rows = static_cast<int64_t>(rank.size());
  const int64_t cols = static_cast<int64_t>(rank[0].size());
  const at::Tensor u = at::rand({rows, cols}, gen, at::dtype(at::kDouble));
  const auto ua = u.accessor<double, 2>();
  Ids active(rows, std::vector<int64_t>(cols, 1));
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t j = 0; j < cols; ++j) {
      if (rank[t][j] >= 1) active[t][j] = ua[t][j] < weights[t][j] / threshold ? 1 : 0;
    }
  }
  return active;
}

// The kept mask of a routed batch cut into `segments` (empty = one), each
// as if routed alone: its own capacity and, for st_moe with a threshold,
// its own draws from the same seed.
inline Ids HandKeep(const RoutingConfig& c, const HandRoute& r, uint64_t drop_seed,
                    std::vector<int64_t> segments = {}) {
  if (segments.empty()) segments.push_back(static_cast<int64_t>(r.ids.size()));
  const bool random_drop =
      c.method == RoutingMethod::kStMoe && c.second_choice_threshold > 0;
  Ids kept;
  size_t offset = 0;
  for (const int64_t rows : segments) {
    const Ids ids(r.ids.begin() + offset, r.ids.begin() + offset + rows);
    const Ids rank(r.rank.begin() + offset, r.rank.begin() + offset + rows);
    const Matrix w(r.weights.begin() + offset, r.weights.begin() + offset + rows);
    const Ids active = random_drop
                           ? HandActiveMask(rank, w, c.second_choice_threshold, drop_seed)
                           : Ids{};
    const Ids part = HandKeepMask(ids, rank, c.num_experts, HandCapacity(c, rows), active);
    kept.insert(kept.end(), part.begin(), part.end());
    offset += rows;
  }
  return kept;
}

inline int64_t CountDropped(const Ids& kept) {
  int64_t dropped = 0;
  for (const auto& row : kept) {
    for (int64_t v : row) dropped += v == 0;
  }
  return dropped;
}

inline Matrix ToMatrix(const at::Tensor& t) { return ToNested<double>(t); }

inline std::vector<double> ToVector(const at::Tensor& t) {
  const at::Tensor c = t.detach().to(at::kCPU, at::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

}  // namespace himoe::router::testing

#endif  // HIMOE_TESTS_ROUTER_SERVICE_ROUTING_TEST_UTIL_H_
