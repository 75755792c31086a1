#include "router_service/routing/dispatch_combine.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "router_service/routing/router_layer.h"

namespace himoe::router {
namespace {

// A routing decision as the router makes it: K = 4 picks per token over 3
// groups of 2 experts, so a token sends 0, 1 or 2 rows to a group; a quarter
// of the picks dropped (capacity), so some tokens send nothing at all.
struct Decision {
  at::Tensor ids, weights, kept;  // [T, 4]
};

Decision RandomDecision(int64_t tokens, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Decision d;
  d.ids = at::randint(0, 6, {tokens, 4}, gen, at::kLong);
  d.weights = at::rand({tokens, 4}, gen).requires_grad_(true);
  d.kept = at::rand({tokens, 4}, gen).gt(0.25);
  return d;
}

std::vector<GroupDispatch> RandomPlan(int64_t tokens, uint64_t seed) {
  const Decision d = RandomDecision(tokens, seed);
  return BuildDispatchPlan(d.ids, d.weights, d.kept, /*num_groups=*/3, /*experts_per_group=*/2);
}

// The oracle: a dense per-token loop over the K picks in double, with no
// dispatch plan. Expert e is y = x * a[e] + b[e] (elementwise), so
//   out[t]       = sum_{j kept} w[t][j] * (x[t] * a[e] + b[e]),
//   dx[t]        = sum_{j kept} w[t][j] * a[e] * go[t],
//   dw[t][j]     = <go[t], x[t] * a[e] + b[e]> if kept, else 0,
//   da[e], db[e] = sum over the kept picks of e of w * go[t] * x[t], w * go[t].
struct PerTokenReference {
  std::vector<std::vector<double>> out, grad_x, grad_w, grad_a, grad_b;
};

PerTokenReference PerTokenLoops(const Decision& dec, const at::Tensor& x, const at::Tensor& a,
                        const at::Tensor& b, const at::Tensor& grad_out) {
  const at::Tensor xd = x.detach().to(at::kDouble), ad = a.detach().to(at::kDouble);
  const at::Tensor bd = b.detach().to(at::kDouble), go = grad_out.to(at::kDouble);
  const at::Tensor wd = dec.weights.detach().to(at::kDouble);
  const auto xs = xd.accessor<double, 2>(), as = ad.accessor<double, 2>();
  const auto bs = bd.accessor<double, 2>(), gs = go.accessor<double, 2>();
  const auto ws = wd.accessor<double, 2>();
  const auto ids = dec.ids.accessor<int64_t, 2>();
  const auto kept = dec.kept.accessor<bool, 2>();
  const int64_t tokens = x.size(0), d = x.size(1), experts = a.size(0);
  PerTokenReference r;
  r.out.assign(tokens, std::vector<double>(d, 0.0));
  r.grad_x.assign(tokens, std::vector<double>(d, 0.0));
  r.grad_w.assign(tokens, std::vector<double>(4, 0.0));
  r.grad_a.assign(experts, std::vector<double>(d, 0.0));
  r.grad_b.assign(experts, std::vector<double>(d, 0.0));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < 4; ++j) {
      if (!kept[t][j]) continue;
      const int64_t e = ids[t][j];
      const double w = ws[t][j];
      for (int64_t c = 0; c < d; ++c) {
        const double y = xs[t][c] * as[e][c] + bs[e][c];
        r.out[t][c] += w * y;
        r.grad_x[t][c] += w * as[e][c] * gs[t][c];
        r.grad_w[t][j] += gs[t][c] * y;
        r.grad_a[e][c] += w * gs[t][c] * xs[t][c];
        r.grad_b[e][c] += w * gs[t][c];
      }
    }
  }
  return r;
}

double MaxAbs(const at::Tensor& got, const std::vector<std::vector<double>>& want) {
  const at::Tensor g = got.detach().to(at::kDouble).contiguous();
  const auto ga = g.accessor<double, 2>();
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    for (size_t j = 0; j < want[i].size(); ++j) {
      worst = std::max(worst, std::abs(ga[i][j] - want[i][j]));
    }
  }
  return worst;
}

// Dispatch, the experts, then combine, with autograd, against the per-token
// loops, at widths with and without a tail past the 16-value lanes: the
// output, x's gradient, the router weights' gradient (exactly 0 where
// dropped) and the experts' gradients, which see the rows' gradients.
TEST(DispatchCombineTest, MatchThePerTokenLoops) {
  for (const int64_t d : {20, 128}) {
    const int64_t tokens = 37;
    const Decision dec = RandomDecision(tokens, 7 + d);
    const std::vector<GroupDispatch> plan = BuildDispatchPlan(dec.ids, dec.weights, dec.kept, 3, 2);
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(100 + d);
    const at::Tensor x = at::randn({tokens, d}, gen).requires_grad_(true);
    const at::Tensor a = at::randn({6, d}, gen).requires_grad_(true);
    const at::Tensor b = at::randn({6, d}, gen).requires_grad_(true);
    const at::Tensor grad_out = at::randn({tokens, d}, gen);
    const std::vector<at::Tensor> rows = DispatchGroupRows(x, plan);
    ASSERT_EQ(rows.size(), plan.size());
    std::vector<at::Tensor> ys;
    for (size_t g = 0; g < plan.size(); ++g) {
      ys.push_back(rows[g] * a.index_select(0, plan[g].expert_ids) +
                   b.index_select(0, plan[g].expert_ids));
    }
    const at::Tensor out = CombineGroupOutputs(tokens, d, plan, ys);
    out.backward(grad_out);

    const PerTokenReference want = PerTokenLoops(dec, x, a, b, grad_out);
    EXPECT_LT(MaxAbs(out, want.out), 1e-5) << "d " << d;
    EXPECT_LT(MaxAbs(x.grad(), want.grad_x), 1e-5) << "d " << d;
    EXPECT_LT(MaxAbs(dec.weights.grad(), want.grad_w), 1e-4) << "d " << d;
    EXPECT_LT(MaxAbs(a.grad(), want.grad_a), 1e-5) << "d " << d;
    EXPECT_LT(MaxAbs(b.grad(), want.grad_b), 1e-5) << "d " << d;
    // Dropped picks get exactly zero.
    EXPECT_EQ(dec.weights.grad().masked_select(dec.kept.logical_not()).abs().sum().item<double>(),
              0.0);
  }
}

// A token's sum is its own: 1 and 2 threads give the same bits, and a
// token's output does not change when other tokens are added to the batch.
TEST(DispatchCombineTest, SameBitsOnAnyThreadCount) {
  const int64_t tokens = 301, d = 40;
  const std::vector<GroupDispatch> plan = RandomPlan(tokens, 11);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(12);
  const at::Tensor x = at::randn({tokens, d}, gen);
  const at::Tensor grad_out = at::randn({tokens, d}, gen);
  // out, x's gradient, the weights' gradient
  const auto run = [&](int threads) {
    at::set_num_threads(threads);
    const at::Tensor xg = x.clone().requires_grad_(true);
    std::vector<GroupDispatch> own = plan;
    for (GroupDispatch& p : own) p.weights = p.weights.detach().requires_grad_(true);
    std::vector<at::Tensor> ys;
    for (const at::Tensor& r : DispatchGroupRows(xg, own)) ys.push_back(r * 1.5f);
    const at::Tensor out = CombineGroupOutputs(tokens, d, own, ys);
    out.backward(grad_out);
    std::vector<at::Tensor> w_grads;
    for (const GroupDispatch& p : own) w_grads.push_back(p.weights.grad());
    return std::vector<at::Tensor>{out.detach(), xg.grad(), at::cat(w_grads)};
  };
  const int threads = at::get_num_threads();
  const std::vector<at::Tensor> one = run(1);
  const std::vector<at::Tensor> two = run(2);
  at::set_num_threads(threads);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(at::equal(one[i], two[i])) << i;

  // Token 0 alone (its rows only) gives the bits it has in the batch.
  std::vector<GroupDispatch> alone;
  std::vector<at::Tensor> ys_alone, ys_all;
  for (const GroupDispatch& p : plan) {
    const at::Tensor mine = p.token_rows.eq(0).nonzero().reshape(-1);
    GroupDispatch a;
    a.token_rows = p.token_rows.index_select(0, mine);
    a.expert_ids = p.expert_ids.index_select(0, mine);
    a.weights = p.weights.detach().index_select(0, mine);
    a.slots = p.slots.index_select(0, mine);
    alone.push_back(a);
    ys_all.push_back(x.index_select(0, p.token_rows) * 1.5f);
    ys_alone.push_back(ys_all.back().index_select(0, mine));
  }
  at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(CombineGroupOutputs(1, d, alone, ys_alone)[0],
                        CombineGroupOutputs(tokens, d, plan, ys_all)[0]));
}

// Only some groups' rows reach the loss: the others' gradients are
// undefined, and x's gradient is the used rows' alone.
TEST(DispatchCombineTest, RowsWithoutGradientCountAsZero) {
  const int64_t tokens = 23, d = 17;
  const std::vector<GroupDispatch> plan = RandomPlan(tokens, 5);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(6);
  const at::Tensor x = at::randn({tokens, d}, gen).requires_grad_(true);
  const std::vector<at::Tensor> rows = DispatchGroupRows(x, plan);
  ASSERT_GT(rows[1].size(0), 0);
  rows[1].sum().backward();
  at::Tensor want = at::zeros({tokens, d});
  for (int64_t i = 0; i < plan[1].token_rows.numel(); ++i) {
    want[plan[1].token_rows[i].item<int64_t>()] += 1.0f;
  }
  EXPECT_TRUE(at::equal(x.grad(), want));
}

// A row index outside the batch is an error, not a read past the tensor.
TEST(DispatchCombineTest, TokenRowOutsideTheBatchIsAnError) {
  GroupDispatch d;
  d.token_rows = at::tensor({0, 5}, at::kLong);
  d.expert_ids = at::tensor({0, 0}, at::kLong);
  d.weights = at::ones({2});
  d.slots = at::tensor({0, 1}, at::kLong);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(4);
  const at::Tensor x = at::randn({3, 16}, gen);
  EXPECT_THROW(
      {
        try {
          DispatchGroupRows(x, {d});
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("token row 5 is outside [0, 3)"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      c10::Error);
  EXPECT_THROW(CombineGroupOutputs(3, 16, {d}, {at::randn({2, 16}, gen)}), c10::Error);
}

// Elsewhere (here: double tensors) the ATen ops answer, with the same values.
TEST(DispatchCombineTest, OtherDtypesTakeTheAtenOps) {
  const int64_t tokens = 19, d = 16;
  const std::vector<GroupDispatch> plan = RandomPlan(tokens, 9);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(10);
  const at::Tensor x = at::randn({tokens, d}, gen, at::dtype(at::kDouble)).requires_grad_(true);
  const std::vector<at::Tensor> rows = DispatchGroupRows(x, plan);
  for (size_t g = 0; g < plan.size(); ++g) {
    EXPECT_TRUE(at::equal(rows[g], x.detach().index_select(0, plan[g].token_rows)));
  }
  at::Tensor total = at::zeros({}, at::kDouble);
  for (const at::Tensor& r : rows) total = total + r.sum();
  total.backward();
  at::Tensor want = at::zeros({tokens, d}, at::kDouble);
  for (const GroupDispatch& p : plan) {
    for (int64_t i = 0; i < p.token_rows.numel(); ++i) want[p.token_rows[i].item<int64_t>()] += 1.0;
  }
  EXPECT_TRUE(at::equal(x.grad(), want));
}

// Each token once: the distinct rows ascending, every assignment pointing at
// its own token, checked against a hand-made dispatch.
TEST(DispatchCombineTest, DistinctTokenRowsListEachTokenOnce) {
  GroupDispatch d;
  // Expert-sorted assignments of tokens 6, 2, 6, 0, 2 (token 6 and 2 twice).
  d.token_rows = at::tensor(std::vector<int64_t>{6, 2, 6, 0, 2});
  const DistinctTokens once = DistinctTokenRows(8, d);
  EXPECT_TRUE(at::equal(once.tokens, at::tensor(std::vector<int64_t>{0, 2, 6})));
  EXPECT_TRUE(at::equal(once.rows, at::tensor(std::vector<int64_t>{2, 1, 2, 0, 1})));
  EXPECT_TRUE(at::equal(once.tokens.index_select(0, once.rows), d.token_rows));

  GroupDispatch none;
  none.token_rows = at::empty({0}, at::kLong);
  const DistinctTokens empty = DistinctTokenRows(8, none);
  EXPECT_EQ(empty.tokens.numel(), 0);
  EXPECT_EQ(empty.rows.numel(), 0);
}

}  // namespace
}  // namespace himoe::router
