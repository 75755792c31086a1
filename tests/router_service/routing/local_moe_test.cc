// LocalMoE forward and backward against a dense per-token computation written
// independently here (loop over tokens, sum of weighted expert outputs).
#include "router_service/routing/local_moe.h"

#include <cmath>

#include <gtest/gtest.h>

#include "tests/router_service/routing/routing_test_util.h"

namespace himoe::router {
namespace {

constexpr int64_t kD = 16, kDff = 32, kTokens = 24;

struct Case {
  RoutingMethod method;
  const char* preset;
  double capacity_factor;  // < 0: the preset's
  int k;
};

at::Tensor Gelu(const at::Tensor& h) { return 0.5 * h * (1.0 + at::erf(h / std::sqrt(2.0))); }

struct DoubleParams {
  at::Tensor gate;
  std::vector<std::vector<at::Tensor>> groups;  // [g] -> w1, b1, w2, b2
};

DoubleParams CopyAsDouble(const LocalMoE& moe_const) {
  auto& moe = const_cast<LocalMoE&>(moe_const);
  DoubleParams p;
  p.gate = moe.router().gate_weight().detach().to(at::kDouble).requires_grad_();
  for (int g = 0; g < moe.num_groups(); ++g) {
    std::vector<at::Tensor> params;
    for (const at::Tensor& t : moe.group(g).parameters()) {
      params.push_back(t.detach().to(at::kDouble).requires_grad_());
    }
    p.groups.push_back(params);
  }
  return p;
}

// The routing decision recomputed in the test from x and the gate alone:
// logits by loops in double, gbar updated by hand (himoe, training), the
// oracle's selection and its capacity drop rule. Nothing is read from the
// code's RoutingOutput.
struct HandDecision {
  testing::Ids ids, kept;
  std::vector<double> ema;  // the gbar pi uses (= the EMA after the call)
  testing::Ids ids_on_p;    // what selection on raw p would pick
  double margin = 0;
  int64_t capacity = -1;
};

HandDecision DecideByHand(const RoutingConfig& c, const at::Tensor& x, const at::Tensor& gate,
                          const std::vector<double>& ema_before,
                          const std::vector<double>& bias, bool training) {
  const testing::Matrix xm = testing::ToMatrix(x), w = testing::ToMatrix(gate);
  testing::Matrix logits(xm.size(), std::vector<double>(w.size(), 0.0));
  for (size_t t = 0; t < xm.size(); ++t) {
    for (size_t i = 0; i < w.size(); ++i) {
      for (size_t d = 0; d < xm[t].size(); ++d) logits[t][i] += xm[t][d] * w[i][d];
    }
  }
  HandDecision h;
  h.ema = c.method == RoutingMethod::kHiMoe && training
              ? testing::HandEmaUpdate(ema_before, logits, c.ema_beta)
              : ema_before;
  const testing::HandRoute r = testing::HandRouting(c, logits, h.ema, bias);
  h.ids = r.ids;
  h.margin = testing::HandSelectionMargin(c, r);
  h.capacity = testing::HandCapacity(c, static_cast<int64_t>(xm.size()));
  h.kept = testing::HandKeepMask(r.ids, r.rank, c.num_experts, h.capacity);
  RoutingConfig on_p = c;
  if (on_p.method == RoutingMethod::kHiMoe) on_p.method = RoutingMethod::kMoge;
  h.ids_on_p = testing::HandRouting(on_p, logits, h.ema).ids;
  return h;
}

// out[t] = sum_j kept[t][j] * w[t][j] * FFN_{e[t][j]}(x_t), with the hand
// ids and kept mask, and w recomputed from the gate: softmax of the
// (corrected, with the hand gbar) logits, gathered, renormalized.
at::Tensor DenseReference(const RoutingConfig& c, const at::Tensor& x, const DoubleParams& p,
                          const HandDecision& hand) {
  const at::Tensor logits = at::matmul(x, p.gate.t());
  const at::Tensor ema = at::tensor(hand.ema, at::kDouble);
  const at::Tensor probs = c.method == RoutingMethod::kHiMoe
      ? at::softmax((logits - c.tau * ema) / c.temperature, 1)
      : at::softmax(logits, 1);
  const int s = c.experts_per_group();
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < x.size(0); ++t) {
    at::Tensor w = probs[t].index_select(0, at::tensor(hand.ids[t], at::kLong));
    if (c.renormalize) w = w / w.sum();
    at::Tensor y = at::zeros({kD}, at::kDouble);
    for (size_t j = 0; j < hand.ids[t].size(); ++j) {
      if (!hand.kept[t][j]) continue;
      const auto& g = p.groups[hand.ids[t][j] / s];
      const int64_t e = hand.ids[t][j] % s;
      const at::Tensor h = Gelu(at::mv(g[0][e], x[t]) + g[1][e]);
      y = y + w[j] * (at::mv(g[2][e], h) + g[3][e]);
    }
    rows.push_back(y);
  }
  return at::stack(rows);
}

void ExpectClose(const at::Tensor& got, const at::Tensor& want, double tol, const char* what) {
  const double err = (got.to(at::kDouble) - want).abs().max().item<double>();
  const double scale = want.abs().max().item<double>();
  EXPECT_LE(err, tol * std::max(1.0, scale)) << what;
  EXPECT_GT(scale, 0.0) << what << " is all zero: the comparison proves nothing";
}

class LocalMoETest : public ::testing::TestWithParam<Case> {};

TEST_P(LocalMoETest, ForwardAndBackwardMatchDenseReference) {
  const Case& tc = GetParam();
  at::manual_seed(17);
  LocalMoEOptions o;
  o.routing = testing::Config(tc.method, 8, 4, tc.k);
  ASSERT_TRUE(ApplyPreset(tc.preset, &o.routing).ok());
  if (tc.capacity_factor >= 0) o.routing.capacity_factor = tc.capacity_factor;
  o.routing.tau = 0.2;  // visible correction
  o.shape = testing::Shape(8, 4, kD, kDff, 99);
  auto moe_or = LocalMoE::Create(o);
  ASSERT_TRUE(moe_or.ok()) << moe_or.status();
  LocalMoE& moe = **moe_or;
  std::vector<double> bias(8, 0.0);
  if (tc.method == RoutingMethod::kLossFree) {
    moe.router().loss_free_bias().copy_(at::randn({8}) * 0.05);
    bias = testing::ToVector(moe.router().loss_free_bias());
  }
  if (tc.method == RoutingMethod::kHiMoe) {
    // A non-zero gbar, so pi differs from p and its update matters.
    moe.router().logit_ema().copy_(at::randn({8}) * 0.5);
  }
  const std::vector<double> ema_before = testing::ToVector(moe.router().logit_ema());
  const at::Tensor x = at::randn({kTokens, kD}).requires_grad_();
  const DoubleParams ref_params = CopyAsDouble(moe);
  const at::Tensor x_ref = x.detach().to(at::kDouble).requires_grad_();
  const HandDecision hand = DecideByHand(o.routing, x_ref.detach(), ref_params.gate.detach(),
                                         ema_before, bias, /*training=*/true);
  ASSERT_GT(hand.margin, 1e-5) << "the hand selection is too close to a tie";
  if (tc.method == RoutingMethod::kHiMoe) {
    ASSERT_NE(hand.ids, hand.ids_on_p) << "pi and p select alike: the case proves nothing";
  }

  auto out = moe.Forward(x, /*training=*/true);
  ASSERT_TRUE(out.ok()) << out.status();
  // The routing decision and the EMA, against the hand computation.
  EXPECT_EQ(testing::ToNested(out->routing.expert_ids), hand.ids);
  EXPECT_EQ(out->routing.stats.capacity, hand.capacity);
  EXPECT_EQ(testing::ToNested(out->routing.kept), hand.kept);
  const std::vector<double> ema_after = testing::ToVector(moe.router().logit_ema());
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(ema_after[i], hand.ema[i], 1e-6) << "gbar[" << i << "]";
  if (tc.capacity_factor > 0 && tc.capacity_factor < 1) {
    int64_t dropped = 0;
    for (const auto& row : hand.kept) {
      for (int64_t v : row) dropped += 1 - v;
    }
    EXPECT_GT(dropped, 0);
    EXPECT_EQ(out->routing.stats.dropped, dropped);
  }

  const at::Tensor ref = DenseReference(o.routing, x_ref, ref_params, hand);
  ExpectClose(out->output, ref, 1e-5, "output");

  const at::Tensor upstream = at::randn({kTokens, kD}, at::kDouble);
  (out->output * upstream.to(at::kFloat)).sum().backward();
  (ref * upstream).sum().backward();
  ExpectClose(x.grad(), x_ref.grad(), 1e-5, "dL/dx");
  ExpectClose(moe.router().gate_weight().grad(), ref_params.gate.grad(), 1e-5, "dL/dW_gate");
  for (int g = 0; g < 4; ++g) {
    const auto params = moe.group(g).parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& want = ref_params.groups[g][i].grad();
      if (!want.defined()) {  // no token reached this group
        EXPECT_FALSE(params[i].grad().defined() && params[i].grad().ne(0).any().item<bool>());
        continue;
      }
      ExpectClose(params[i].grad(), want, 1e-5, "expert parameter grad");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Methods, LocalMoETest,
    ::testing::Values(Case{RoutingMethod::kVanilla, "paper", -1, 1},
                      Case{RoutingMethod::kStMoe, "paper", -1, 1},
                      Case{RoutingMethod::kLossFree, "paper", -1, 1},
                      Case{RoutingMethod::kMoge, "paper", -1, 2},
                      Case{RoutingMethod::kHiMoe, "paper", -1, 1},
                      Case{RoutingMethod::kHiMoe, "paper", -1, 2},
                      Case{RoutingMethod::kHiMoe, "reference", -1, 1},
                      Case{RoutingMethod::kHiMoe, "paper", 0.5, 1},
                      Case{RoutingMethod::kHiMoe, "paper", 0.5, 2},
                      Case{RoutingMethod::kMoge, "paper", 0.5, 2},
                      Case{RoutingMethod::kVanilla, "reference", 0.5, 2}),
    [](const auto& info) {
      const Case& c = info.param;
      std::string name = std::string(RoutingMethodName(c.method)) + "_" + c.preset + "_k" +
                         std::to_string(c.k);
      if (c.capacity_factor > 0) name += "_tight_capacity";
      return name;
    });

TEST(LocalMoEBf16Test, Bf16ExpertsStayWithinDocumentedTolerance) {
  // bf16 has an 8-bit mantissa: relative error of the layer output <= 2e-2.
  at::manual_seed(4);
  LocalMoEOptions o;
  o.routing = testing::Config(RoutingMethod::kHiMoe, 8, 4, 1);
  o.shape = testing::Shape(8, 4, kD, kDff, 5);
  auto fp32 = LocalMoE::Create(o);
  o.shape.set_dtype(v1::DTYPE_BFLOAT16);
  auto bf16 = LocalMoE::Create(o);
  ASSERT_TRUE(fp32.ok() && bf16.ok());
  const at::Tensor x = at::randn({kTokens, kD});
  auto a = (*fp32)->Forward(x, false);
  auto b = (*bf16)->Forward(x, false);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(at::equal(a->routing.expert_ids, b->routing.expert_ids));
  // Both route in fp32: the ids are the hand selection (eval, gbar = 0).
  const HandDecision hand =
      DecideByHand(o.routing, x.to(at::kDouble), (*fp32)->router().gate_weight().detach(),
                   std::vector<double>(8, 0.0), {}, /*training=*/false);
  EXPECT_EQ(testing::ToNested(a->routing.expert_ids), hand.ids);
  const double rel = ((b->output - a->output).norm() / a->output.norm()).item<double>();
  EXPECT_LT(rel, 2e-2);
  EXPECT_GT(rel, 0.0);  // it really ran in bf16
}

TEST(LocalMoETest, RejectsWrongWidth) {
  LocalMoEOptions o;
  o.routing = testing::Config(RoutingMethod::kHiMoe, 8, 4, 1);
  o.shape = testing::Shape(8, 4, kD, kDff, 0);
  auto moe = LocalMoE::Create(o);
  ASSERT_TRUE(moe.ok());
  auto out = (*moe)->Forward(at::randn({3, kD + 1}), false);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("d_model=16"), std::string::npos) << out.status();
}

}  // namespace
}  // namespace himoe::router
