#include "router_service/routing/dispatch_combine.h"

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "router_service/routing/router_layer.h"

namespace himoe::router {
namespace {

// A plan as the router makes it: K = 4 picks per token over 3 groups of 2
// experts, so a token sends 0, 1 or 2 rows to a group; a quarter of the
// picks dropped (capacity), so some tokens send nothing at all.
std::vector<GroupDispatch> RandomPlan(int64_t tokens, uint64_t seed) {
  at::manual_seed(seed);
  const at::Tensor ids = at::randint(0, 6, {tokens, 4}, at::kLong);
  const at::Tensor weights = at::rand({tokens, 4}).requires_grad_(true);
  const at::Tensor kept = at::rand({tokens, 4}).gt(0.25);
  return BuildDispatchPlan(ids, weights, kept, /*num_groups=*/3, /*experts_per_group=*/2);
}

// The oracle: plain loops in double over the plan.
struct Reference {
  at::Tensor out;                 // [T, d]: sum of w * y per token
  at::Tensor grad_x;              // [T, d]: sum of the rows' gradients per token
  std::vector<at::Tensor> grad_y;  // w * grad_out[t]
  std::vector<at::Tensor> grad_w;  // <grad_out[t], y>
};

Reference Compute(int64_t tokens, int64_t d, const std::vector<GroupDispatch>& plan,
                  const std::vector<at::Tensor>& ys, const std::vector<at::Tensor>& row_grads,
                  const at::Tensor& grad_out) {
  Reference r;
  r.out = at::zeros({tokens, d}, at::kDouble);
  r.grad_x = at::zeros({tokens, d}, at::kDouble);
  const at::Tensor go = grad_out.to(at::kDouble);
  for (size_t g = 0; g < plan.size(); ++g) {
    const int64_t n = plan[g].token_rows.numel();
    const at::Tensor y = ys[g].detach().to(at::kDouble);
    const at::Tensor w = plan[g].weights.detach().to(at::kDouble);
    const at::Tensor rg = row_grads[g].to(at::kDouble);
    at::Tensor gy = at::zeros({n, d}, at::kDouble);
    at::Tensor gw = at::zeros({n}, at::kDouble);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = plan[g].token_rows[i].item<int64_t>();
      const double wi = w[i].item<double>();
      for (int64_t c = 0; c < d; ++c) {
        const double yc = y[i][c].item<double>();
        const double goc = go[t][c].item<double>();
        r.out[t][c] += wi * yc;
        r.grad_x[t][c] += rg[i][c].item<double>();
        gy[i][c] = wi * goc;
        gw[i] += goc * yc;
      }
    }
    r.grad_y.push_back(gy);
    r.grad_w.push_back(gw);
  }
  return r;
}

double MaxAbs(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0) return 0;
  return (a.to(at::kDouble) - b).abs().max().item<double>();
}

// Dispatch then combine with autograd against the double loops, at widths
// with and without a tail past the 16-value lanes. The rows are x's rows
// exactly; the rows' gradients are arbitrary (a loss through random
// coefficients), so the dispatch backward is checked on its own.
TEST(DispatchCombineTest, MatchTheReferenceLoops) {
  for (const int64_t d : {20, 128}) {
    const int64_t tokens = 37;
    const std::vector<GroupDispatch> plan = RandomPlan(tokens, 7 + d);
    const at::Tensor x = at::randn({tokens, d}).requires_grad_(true);
    const std::vector<at::Tensor> rows = DispatchGroupRows(x, plan);
    ASSERT_EQ(rows.size(), plan.size());
    std::vector<at::Tensor> ys, coeffs;
    for (size_t g = 0; g < plan.size(); ++g) {
      ASSERT_TRUE(at::equal(rows[g], x.detach().index_select(0, plan[g].token_rows)));
      coeffs.push_back(at::randn(rows[g].sizes()));
      // y depends on the rows (so x gets a gradient through it) and is a leaf
      // of its own for the reference.
      ys.push_back(rows[g] * coeffs.back());
      ys.back().retain_grad();
    }
    const at::Tensor out = CombineGroupOutputs(tokens, d, plan, ys);
    const at::Tensor grad_out = at::randn({tokens, d});
    out.backward(grad_out);

    std::vector<at::Tensor> row_grads;
    for (size_t g = 0; g < plan.size(); ++g) {
      row_grads.push_back(ys[g].grad() * coeffs[g]);
    }
    const Reference want = Compute(tokens, d, plan, ys, row_grads, grad_out);
    EXPECT_LT(MaxAbs(out, want.out), 1e-5) << "d " << d;
    EXPECT_LT(MaxAbs(x.grad(), want.grad_x), 1e-5) << "d " << d;
    for (size_t g = 0; g < plan.size(); ++g) {
      EXPECT_LT(MaxAbs(ys[g].grad(), want.grad_y[g]), 1e-6) << "group " << g;
    }
  }
}

// The weights' gradient reaches the router's [T, K] weights: for each
// assignment (t, j) kept, <grad_out[t], y of that row>; 0 where dropped.
TEST(DispatchCombineTest, WeightGradientReachesTheRouterWeights) {
  const int64_t tokens = 29, d = 24;
  at::manual_seed(3);
  const at::Tensor ids = at::randint(0, 6, {tokens, 4}, at::kLong);
  const at::Tensor weights = at::rand({tokens, 4}).requires_grad_(true);
  const at::Tensor kept = at::rand({tokens, 4}).gt(0.25);
  const std::vector<GroupDispatch> plan = BuildDispatchPlan(ids, weights, kept, 3, 2);
  std::vector<at::Tensor> ys;
  for (const GroupDispatch& p : plan) ys.push_back(at::randn({p.token_rows.numel(), d}));
  const at::Tensor grad_out = at::randn({tokens, d});
  CombineGroupOutputs(tokens, d, plan, ys).backward(grad_out);

  at::Tensor want = at::zeros({tokens * 4}, at::kDouble);
  for (size_t g = 0; g < plan.size(); ++g) {
    for (int64_t i = 0; i < plan[g].token_rows.numel(); ++i) {
      const int64_t slot = plan[g].slots[i].item<int64_t>();
      const int64_t t = plan[g].token_rows[i].item<int64_t>();
      double dot = 0;
      for (int64_t c = 0; c < d; ++c) {
        dot += grad_out[t][c].item<double>() * ys[g][i][c].item<double>();
      }
      want[slot] = dot;
    }
  }
  EXPECT_LT(MaxAbs(weights.grad().reshape(-1), want), 1e-5);
  // Dropped picks get exactly zero.
  EXPECT_EQ(weights.grad().masked_select(kept.logical_not()).abs().sum().item<double>(), 0.0);
}

// A token's sum is its own: 1 and 2 threads give the same bits, and a
// token's output does not change when other tokens are added to the batch.
TEST(DispatchCombineTest, SameBitsOnAnyThreadCount) {
  const int64_t tokens = 301, d = 40;
  const std::vector<GroupDispatch> plan = RandomPlan(tokens, 11);
  const at::Tensor x = at::randn({tokens, d});
  const at::Tensor grad_out = at::randn({tokens, d});
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
  const at::Tensor x = at::randn({tokens, d}).requires_grad_(true);
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
  const at::Tensor x = at::randn({3, 16});
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
  EXPECT_THROW(CombineGroupOutputs(3, 16, {d}, {at::randn({2, 16})}), c10::Error);
}

// Elsewhere (here: double tensors) the ATen ops answer, with the same values.
TEST(DispatchCombineTest, OtherDtypesTakeTheAtenOps) {
  const int64_t tokens = 19, d = 16;
  const std::vector<GroupDispatch> plan = RandomPlan(tokens, 9);
  const at::Tensor x = at::randn({tokens, d}, at::kDouble).requires_grad_(true);
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

}  // namespace
}  // namespace himoe::router
