// LocalMoE forward and backward against a dense per-token computation written
// independently here (loop over tokens, sum of weighted expert outputs).
#include "router_service/local_moe.h"

#include <cmath>

#include <gtest/gtest.h>

#include "tests/router_service/routing_test_util.h"

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

// out[t] = sum_j kept[t][j] * w[t][j] * FFN_{e[t][j]}(x_t), with w recomputed
// from the gate: softmax of the (corrected) logits, gathered, renormalized.
at::Tensor DenseReference(const RoutingConfig& c, const at::Tensor& x, const DoubleParams& p,
                          const at::Tensor& ema, const RoutingOutput& routing) {
  const at::Tensor logits = at::matmul(x, p.gate.t());
  const at::Tensor probs = c.method == RoutingMethod::kHiMoe
      ? at::softmax((logits - c.tau * ema.to(at::kDouble)) / c.temperature, 1)
      : at::softmax(logits, 1);
  const auto ids = testing::ToNested(routing.expert_ids);
  const auto kept = testing::ToNested(routing.kept);
  const int s = c.experts_per_group();
  std::vector<at::Tensor> rows;
  for (int64_t t = 0; t < x.size(0); ++t) {
    at::Tensor w = probs[t].index_select(0, routing.expert_ids[t]);
    if (c.renormalize) w = w / w.sum();
    at::Tensor y = at::zeros({kD}, at::kDouble);
    for (size_t j = 0; j < ids[t].size(); ++j) {
      if (!kept[t][j]) continue;
      const auto& g = p.groups[ids[t][j] / s];
      const int64_t e = ids[t][j] % s;
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
  if (tc.method == RoutingMethod::kLossFree) {
    moe.router().loss_free_bias().copy_(at::randn({8}) * 0.05);
  }
  const at::Tensor x = at::randn({kTokens, kD}).requires_grad_();
  auto out = moe.Forward(x, /*training=*/true);
  ASSERT_TRUE(out.ok()) << out.status();
  if (tc.capacity_factor > 0 && tc.capacity_factor < 1) {
    EXPECT_GT(out->routing.stats.dropped, 0);
  }

  const DoubleParams ref_params = CopyAsDouble(moe);
  const at::Tensor x_ref = x.detach().to(at::kDouble).requires_grad_();
  const at::Tensor ref = DenseReference(o.routing, x_ref, ref_params,
                                        moe.router().logit_ema(), out->routing);
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
