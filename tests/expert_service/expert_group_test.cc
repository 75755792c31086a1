#include "expert_service/expert_group.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/linear.h"
#include "tests/rowwise_rows_test.h"

namespace himoe::expert {
namespace {

using ::testing::HasSubstr;

const c10::Device kCpu(c10::kCPU);

// The oracle: expert e's FFN on one row x by hand, p = {W1, b1, W2, b2}.
at::Tensor RowFfn(const std::vector<at::Tensor>& p, int64_t e, const at::Tensor& x) {
  const at::Tensor h = at::mv(p[0][e], x) + p[1][e];
  const at::Tensor gelu = 0.5 * h * (1 + at::erf(h / std::sqrt(2.0)));
  return at::mv(p[2][e], gelu) + p[3][e];
}

// The oracle on copies of `rows` and of group 1's parameters (experts 3-5):
// each row's RowFfn, and their gradients by autograd for the loss
// sum_r <y_r, weights_r>.
struct Oracle {
  std::vector<at::Tensor> ys;
  at::Tensor rows_grad;
  std::vector<at::Tensor> param_grads;  // W1, b1, W2, b2
};

Oracle PerRowOracle(const ExpertGroup& group, const at::Tensor& rows, const at::Tensor& ids,
                    const at::Tensor& weights) {
  std::vector<at::Tensor> p;
  for (const at::Tensor& t : group.parameters()) {
    p.push_back(t.detach().clone().requires_grad_(true));
  }
  const at::Tensor ref_rows = rows.detach().clone().requires_grad_(true);
  Oracle o;
  at::Tensor loss = at::zeros({});
  for (int64_t r = 0; r < rows.size(0); ++r) {
    o.ys.push_back(RowFfn(p, ids[r].item<int64_t>() - 3, ref_rows[r]));
    loss = loss + (o.ys.back() * weights[r]).sum();
  }
  loss.backward();
  o.rows_grad = ref_rows.grad();
  for (const at::Tensor& t : p) o.param_grads.push_back(t.grad());
  return o;
}

}  // namespace

void PrintTo(const RowPiece& p, std::ostream* os) {
  *os << "{expert " << p.expert << ", rows " << p.begin << "+" << p.count
      << (p.whole ? ", whole}" : ", part}");
}

namespace {

// M = 2 groups of 3 experts; group 1 holds experts 3, 4, 5.
v1::ExpertShape Shape(v1::DType dtype = v1::DTYPE_FLOAT32) {
  v1::ExpertShape s;
  s.set_num_experts(6);
  s.set_num_groups(2);
  s.set_num_layers(4);
  s.set_d_model(8);
  s.set_d_ff(12);
  s.set_seed(42);
  s.set_dtype(dtype);
  return s;
}

TEST(ExpertGroupTest, WeightsDependOnlyOnSeedLayerAndExpert) {
  auto a = ExpertGroup::Create(Shape(), 1, 2, kCpu);
  auto b = ExpertGroup::Create(Shape(), 1, 2, kCpu);
  auto c = ExpertGroup::Create(Shape(), 1, 3, kCpu);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(at::equal((*a)->parameters()[i], (*b)->parameters()[i]));
    EXPECT_FALSE(at::equal((*a)->parameters()[i], (*c)->parameters()[i]));
  }
  // nn.Linear init bound 1/sqrt(fan_in).
  EXPECT_LE((*a)->parameters()[0].abs().max().item<double>(), 1 / std::sqrt(8.0));
  EXPECT_EQ((*a)->first_expert(), 3);
  EXPECT_EQ((*a)->experts_per_group(), 3);
  EXPECT_EQ((*a)->group_id(), 1);
  EXPECT_EQ((*a)->layer(), 2);
  EXPECT_TRUE((*a)->owns(5));
  EXPECT_FALSE((*a)->owns(6));
}

TEST(ExpertGroupTest, SwitchInitIsTheReleasedCodes) {
  // d 128, d_ff 512, 2 experts: W1 truncated normal of std sqrt(0.1/128) cut
  // at 2 std (sample std 0.8796 of it), W2 N(0, 0.02/sqrt(2*4)), biases 0.
  v1::ExpertShape shape;
  shape.set_num_experts(2);
  shape.set_num_groups(1);
  shape.set_num_layers(1);
  shape.set_d_model(128);
  shape.set_d_ff(512);
  shape.set_seed(3);
  shape.set_dtype(v1::DTYPE_FLOAT32);
  shape.set_init(v1::WEIGHT_INIT_SWITCH);
  shape.set_n_layer(4);
  auto g = ExpertGroup::Create(shape, 0, 0, kCpu);
  ASSERT_TRUE(g.ok()) << g.status();
  const std::vector<at::Tensor> p = (*g)->parameters();  // w1, b1, w2, b2
  const double w1_std = std::sqrt(0.1 / 128), w2_std = 0.02 / std::sqrt(8.0);
  EXPECT_LE(p[0].abs().max().item<double>(), 2 * w1_std);
  EXPECT_NEAR(p[0].std().item<double>(), 0.8796 * w1_std, 0.01 * w1_std);
  EXPECT_NEAR(p[2].std().item<double>(), w2_std, 0.01 * w2_std);
  EXPECT_GT(p[2].abs().max().item<double>(), 3.5 * w2_std);  // not truncated
  EXPECT_EQ(p[1].abs().max().item<double>(), 0.0);
  EXPECT_EQ(p[3].abs().max().item<double>(), 0.0);
  // Still a function of (seed, layer, expert) alone.
  auto again = ExpertGroup::Create(shape, 0, 0, kCpu);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(at::equal(p[0], (*again)->parameters()[0]));
}

TEST(ExpertGroupTest, AnExpertIsTheSameWhateverGroupHoldsIt) {
  // One group of all 6 experts holds group 1's experts 3..5 at rows 3..5.
  v1::ExpertShape whole = Shape();
  whole.set_num_groups(1);
  auto all = ExpertGroup::Create(whole, 0, 2, kCpu);
  auto part = ExpertGroup::Create(Shape(), 1, 2, kCpu);
  ASSERT_TRUE(all.ok() && part.ok());
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(at::equal((*all)->parameters()[i].narrow(0, 3, 3), (*part)->parameters()[i]))
        << (*part)->named_parameters()[i].first;
  }
}

// Forward through the general path and, with himoe::Linear rowwise, through
// the few-rows path (fewer than 8 rows: each row its expert's GEMVs).
class ExpertGroupForwardTest : public test_util::RowwiseRowsTest {};

TEST_P(ExpertGroupForwardTest, AppliesEachRowsOwnExpert) {
  auto group = ExpertGroup::Create(Shape(), 1, 2, kCpu);
  ASSERT_TRUE(group.ok());
  const at::Tensor rows = at::randn({7, 8});
  const at::Tensor ids = at::tensor({5, 3, 4, 5, 3, 3, 5}, at::kLong);
  auto out = (*group)->Forward(rows, ids);
  ASSERT_TRUE(out.ok()) << out.status();
  const auto p = (*group)->parameters();
  for (int64_t r = 0; r < 7; ++r) {
    const int64_t e = ids[r].item<int64_t>() - 3;
    const at::Tensor y = RowFfn(p, e, rows[r]);
    EXPECT_TRUE(at::allclose((*out)[r], y, 1e-5, 1e-6)) << "row " << r;
  }
}

// Gradients w.r.t. the rows and the weights, against autograd through the
// hand-written expert FFN of each row.
TEST_P(ExpertGroupForwardTest, GradientsMatchEachRowsOwnExpert) {
  auto group = ExpertGroup::Create(Shape(), 1, 2, kCpu);
  ASSERT_TRUE(group.ok());
  const at::Tensor rows = at::randn({5, 8}).requires_grad_(true);
  const at::Tensor ids = at::tensor({4, 3, 4, 5, 3}, at::kLong);
  const at::Tensor weights = at::randn({5, 8});
  auto out = (*group)->Forward(rows, ids);
  ASSERT_TRUE(out.ok()) << out.status();
  (*out * weights).sum().backward();
  const Oracle want = PerRowOracle(**group, rows, ids, weights);
  EXPECT_TRUE(at::allclose(rows.grad(), want.rows_grad, 1e-5, 1e-6));
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(at::allclose((*group)->parameters()[i].grad(), want.param_grads[i], 1e-5, 1e-6))
        << (*group)->named_parameters()[i].first;
  }
}

TEST_P(ExpertGroupForwardTest, RejectsExpertOutsideGroupAndWrongWidth) {
  auto group = ExpertGroup::Create(Shape(), 1, 2, kCpu);
  ASSERT_TRUE(group.ok());
  auto outside = (*group)->Forward(at::randn({2, 8}), at::tensor({3, 6}, at::kLong));
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(outside.status().message().find("must be in [3, 6)"), std::string::npos);
  auto width = (*group)->Forward(at::randn({2, 9}), at::tensor({3, 4}, at::kLong));
  EXPECT_EQ(width.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(width.status().message().find("d_model=8"), std::string::npos);
  EXPECT_EQ(ExpertGroup::Create(Shape(v1::DTYPE_INT64), 0, 2, kCpu).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(ExpertGroupForwardTest, Bf16GroupComputesInBf16) {
  auto group = ExpertGroup::Create(Shape(v1::DTYPE_BFLOAT16), 0, 2, kCpu);
  ASSERT_TRUE(group.ok());
  EXPECT_EQ((*group)->dtype(), at::kBFloat16);
  const at::Tensor rows = at::randn({4, 8});
  auto out = (*group)->Forward(rows, at::tensor({0, 1, 2, 0}, at::kLong));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->scalar_type(), at::kBFloat16);
  // Within bf16 rounding of the float32 experts' output.
  auto f32 = ExpertGroup::Create(Shape(), 0, 2, kCpu);
  ASSERT_TRUE(f32.ok());
  auto want = (*f32)->Forward(rows, at::tensor({0, 1, 2, 0}, at::kLong));
  ASSERT_TRUE(want.ok());
  EXPECT_TRUE(at::allclose(out->to(at::kFloat), *want, 5e-2, 5e-2));
}

// The experts' products split across threads (GroupedExpertFfn): the output
// and every gradient equal the hand-written FFN of each row's expert, at 1
// and 2 threads, for rows sorted by expert (as the backends send them) and
// shuffled, with one expert given no rows (its gradients are zero), and with
// rows that need no gradient (only the weights do).
TEST(ExpertGroupTest, ExpertsSplitAcrossThreadsMatchEachRowsOwnExpert) {
  const int saved_threads = at::get_num_threads();
  at::manual_seed(7);
  const at::Tensor rows = at::randn({24, 8});
  const at::Tensor weights = at::randn({24, 8});
  std::vector<int64_t> sorted_ids(24, 3);
  std::fill(sorted_ids.begin() + 10, sorted_ids.end(), 5);  // expert 4 gets nothing
  const at::Tensor shuffle = at::randperm(24);
  for (const int threads : {1, 2}) {
    for (const bool shuffled : {false, true}) {
      for (const bool rows_need_grad : {true, false}) {
        SCOPED_TRACE(testing::Message() << threads << " threads, shuffled " << shuffled
                                        << ", rows need grad " << rows_need_grad);
        at::set_num_threads(threads);
        auto group = ExpertGroup::Create(Shape(), 1, 2, kCpu);
        ASSERT_TRUE(group.ok());
        at::Tensor ids = at::tensor(sorted_ids, at::kLong);
        at::Tensor x = rows.clone();
        if (shuffled) {
          ids = ids.index_select(0, shuffle);
          x = x.index_select(0, shuffle);
        }
        x.requires_grad_(rows_need_grad);
        auto out = (*group)->Forward(x, ids);
        ASSERT_TRUE(out.ok()) << out.status();
        (*out * weights).sum().backward();

        const Oracle want = PerRowOracle(**group, x, ids, weights);
        for (int64_t r = 0; r < 24; ++r) {
          EXPECT_TRUE(at::allclose((*out)[r], want.ys[r], 1e-5, 1e-6)) << "row " << r;
        }
        if (rows_need_grad) {
          EXPECT_TRUE(at::allclose(x.grad(), want.rows_grad, 1e-5, 1e-6));
        } else {
          EXPECT_FALSE(x.grad().defined());
        }
        for (size_t i = 0; i < 4; ++i) {
          const at::Tensor got = (*group)->parameters()[i].grad();
          EXPECT_TRUE(at::allclose(got, want.param_grads[i], 1e-5, 1e-6))
              << (*group)->named_parameters()[i].first;
          EXPECT_TRUE(got[1].eq(0).all().item<bool>()) << "expert 4 had no rows";
          EXPECT_GT(got[0].abs().sum().item<double>(), 0);
        }
      }
    }
  }
  at::set_num_threads(saved_threads);
}

// matmul_dtype bfloat16: every product takes bfloat16-rounded operands and
// sums in float32. The oracle, in double per expert: h = R(x) R(W1)^T + b1,
// a = gelu(h), y = R(a) R(W2)^T + b2, and for the loss sum(y * g):
// gh = (R(g) R(W2)) gelu'(h), gx = R(gh) R(W1), gW2 = R(g)^T R(a),
// gW1 = R(gh)^T R(x) (R: round to bfloat16). The GELU (the group's own loop,
// 1e-7 off) can put a value on the other side of a rounding boundary now and
// then, so the test bounds the mean error against this oracle by a small
// fraction of the mean error against the unrounded (float32) one, and the
// largest by 1% of the values' range.
TEST(ExpertGroupTest, Bf16ProductsRoundEachOperandOnce) {
  const int saved_threads = at::get_num_threads();
  at::manual_seed(21);
  v1::ExpertShape shape = Shape();
  shape.set_matmul_dtype(v1::DTYPE_BFLOAT16);
  const at::Tensor rows = at::randn({40, 8});
  const at::Tensor g = at::randn({40, 8});
  std::vector<int64_t> sorted_ids(40, 3);
  std::fill(sorted_ids.begin() + 15, sorted_ids.end(), 4);
  std::fill(sorted_ids.begin() + 33, sorted_ids.end(), 5);
  const auto R = [](const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kDouble); };
  for (const int threads : {1, 2}) {
    SCOPED_TRACE(testing::Message() << threads << " threads");
    at::set_num_threads(threads);
    auto group = ExpertGroup::Create(shape, 1, 2, kCpu);
    ASSERT_TRUE(group.ok()) << group.status();
    ASSERT_TRUE((*group)->matmul_bf16());
    const at::Tensor x = rows.clone().requires_grad_(true);
    auto out = (*group)->Forward(x, at::tensor(sorted_ids, at::kLong));
    ASSERT_TRUE(out.ok()) << out.status();
    (*out * g).sum().backward();
    const std::vector<at::Tensor> p = (*group)->parameters();  // W1, b1, W2, b2

    // Per expert e, rows [begin, end); with and without the rounding.
    for (const bool rounded : {true, false}) {
      const auto Q = [&](const at::Tensor& t) { return rounded ? R(t) : t.to(at::kDouble); };
      at::Tensor y = at::empty({40, 8}, at::kDouble), gx = at::empty({40, 8}, at::kDouble);
      std::vector<at::Tensor> gp;
      for (const at::Tensor& t : p) gp.push_back(at::zeros(t.sizes(), at::kDouble));
      for (const auto& [e, begin, end] : std::vector<std::array<int64_t, 3>>{
               {0, 0, 15}, {1, 15, 33}, {2, 33, 40}}) {
        const at::Tensor xe = rows.narrow(0, begin, end - begin);
        const at::Tensor ge = g.narrow(0, begin, end - begin);
        const at::Tensor h = at::mm(Q(xe), Q(p[0][e]).t()) + p[1][e].to(at::kDouble);
        const at::Tensor cdf = 0.5 * (1 + at::erf(h / std::sqrt(2.0)));
        const at::Tensor a = h * cdf;
        y.narrow(0, begin, end - begin).copy_(at::mm(Q(a), Q(p[2][e]).t()) +
                                              p[3][e].to(at::kDouble));
        const at::Tensor pdf = at::exp(-0.5 * h * h) / std::sqrt(2 * M_PI);
        const at::Tensor gh = at::mm(Q(ge), Q(p[2][e])) * (cdf + h * pdf);
        gx.narrow(0, begin, end - begin).copy_(at::mm(Q(gh), Q(p[0][e])));
        gp[0][e].copy_(at::mm(Q(gh).t(), Q(xe)));
        gp[1][e].copy_(gh.sum(0));
        gp[2][e].copy_(at::mm(Q(ge).t(), Q(a)));
        gp[3][e].copy_(ge.to(at::kDouble).sum(0));
      }
      std::vector<std::pair<std::string, std::pair<at::Tensor, at::Tensor>>> pairs = {
          {"y", {*out, y}}, {"rows' grad", {x.grad(), gx}}};
      for (size_t i = 0; i < 4; ++i) {
        pairs.push_back({(*group)->named_parameters()[i].first, {p[i].grad(), gp[i]}});
      }
      for (const auto& [name, got_want] : pairs) {
        const at::Tensor err = (got_want.first.to(at::kDouble) - got_want.second).abs();
        const double range = got_want.second.abs().max().item<double>();
        if (rounded) {
          EXPECT_LE(err.max().item<double>(), 1e-2 * range) << name;
          EXPECT_LE(err.mean().item<double>(), 1e-4 * range) << name;
        } else if (name != "b2") {  // b2's gradient sums g alone: no product
          // float32 operands would be within 1e-6; bf16 ones are about 2^-9 off.
          EXPECT_GE(err.mean().item<double>(), 1e-4 * range) << name;
        }
      }
    }
  }
  at::set_num_threads(saved_threads);
}

TEST(PlanRowChunksTest, SplitsRowsEvenlyAcrossChunks) {
  using P = RowPiece;
  // 20 and 80 rows in 2 chunks: expert 1 is cut at row 50 (30 + 50 rows).
  EXPECT_EQ(PlanRowChunks({20, 80}, 2, 16),
            (std::vector<std::vector<P>>{{{0, 0, 20, true}, {1, 20, 30, false}},
                                         {{1, 50, 50, false}}}));
  // An expert without rows gets no piece; 3 chunks of 100 rows cut at 33, 67.
  EXPECT_EQ(PlanRowChunks({0, 100, 0}, 3, 16),
            (std::vector<std::vector<P>>{{{1, 0, 33, false}},
                                         {{1, 33, 34, false}},
                                         {{1, 67, 33, false}}}));
  // A cut leaving fewer than min_rows on one side moves to that end: the
  // cut at 50 is 10 rows into expert 1's rows 40-99, so it moves to 40.
  EXPECT_EQ(PlanRowChunks({40, 60}, 2, 16),
            (std::vector<std::vector<P>>{{{0, 0, 40, true}}, {{1, 40, 60, true}}}));
  // ... and 6 rows before the end of expert 0's rows 0-55, so to 56.
  EXPECT_EQ(PlanRowChunks({56, 44}, 2, 16),
            (std::vector<std::vector<P>>{{{0, 0, 56, true}}, {{1, 56, 44, true}}}));
  // One chunk: every expert whole, as before any split.
  EXPECT_EQ(PlanRowChunks({3, 0, 5}, 1, 16),
            (std::vector<std::vector<P>>{{{0, 0, 3, true}, {2, 3, 5, true}}}));
  // Fewer rows than chunks: the empty chunks have no pieces.
  EXPECT_EQ(PlanRowChunks({1, 0}, 2, 16),
            (std::vector<std::vector<P>>{{{0, 0, 1, true}}, {}}));
}

// Group 1 (experts 3-5) on `n` random rows, sorted by expert as `sorted_ids`,
// at `threads` threads: the output, the rows' and the weights' gradients
// equal the hand-written FFN of each row's expert. Returns the weights'
// gradients.
std::vector<at::Tensor> ExpectSortedRowsMatchOracle(const std::vector<int64_t>& sorted_ids,
                                                    int threads) {
  const int saved_threads = at::get_num_threads();
  at::set_num_threads(threads);
  const int64_t n = static_cast<int64_t>(sorted_ids.size());
  const at::Tensor rows = at::randn({n, 8}).requires_grad_(true);
  const at::Tensor weights = at::randn({n, 8});
  const at::Tensor ids = at::tensor(sorted_ids, at::kLong);
  auto group = ExpertGroup::Create(Shape(), 1, 2, kCpu);
  EXPECT_TRUE(group.ok());
  if (!group.ok()) return {};
  auto out = (*group)->Forward(rows, ids);
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return {};
  (*out * weights).sum().backward();
  at::set_num_threads(saved_threads);
  const Oracle want = PerRowOracle(**group, rows, ids, weights);
  for (int64_t r = 0; r < n; ++r) {
    EXPECT_TRUE(at::allclose((*out)[r], want.ys[r], 1e-5, 1e-6)) << "row " << r;
  }
  EXPECT_TRUE(at::allclose(rows.grad(), want.rows_grad, 1e-5, 1e-5));
  std::vector<at::Tensor> grads;
  for (size_t i = 0; i < 4; ++i) {
    grads.push_back((*group)->parameters()[i].grad());
    EXPECT_TRUE(at::allclose(grads.back(), want.param_grads[i], 1e-4, 1e-5))
        << (*group)->named_parameters()[i].first;
  }
  return grads;
}

// Uneven routing at 2 threads: one expert's rows are cut between the
// threads (PlanRowChunks), and its weight gradients are the sum of both
// halves. Everything equals the hand-written FFN of each row's expert.
TEST(ExpertGroupTest, AnExpertSharedByTwoThreadsMatchesEachRowsOwnExpert) {
  at::manual_seed(11);
  // expert 3: 20 rows, expert 4: 100 (cut at 60), expert 5: none
  std::vector<int64_t> sorted_ids(120, 4);
  std::fill(sorted_ids.begin(), sorted_ids.begin() + 20, 3);
  ASSERT_EQ(PlanRowChunks({20, 100, 0}, 2, kMinRowPiece)[1].front(), (RowPiece{1, 60, 60, false}));
  const std::vector<at::Tensor> grads = ExpectSortedRowsMatchOracle(sorted_ids, 2);
  ASSERT_EQ(grads.size(), 4u);
  for (const at::Tensor& g : grads) {
    EXPECT_TRUE(g[2].eq(0).all().item<bool>()) << "expert 5 had no rows";
  }
}

// An expert's rows beyond one GELU tile (128 rows on the CPU): expert 3 gets
// 300 rows (tiles of 128, 128 and 44), expert 5 gets 129 (128 and 1).
TEST(ExpertGroupTest, RowsSpanningSeveralGeluTilesMatchEachRowsOwnExpert) {
  at::manual_seed(13);
  std::vector<int64_t> sorted_ids(429, 3);
  std::fill(sorted_ids.begin() + 300, sorted_ids.end(), 5);
  EXPECT_EQ(ExpectSortedRowsMatchOracle(sorted_ids, 1).size(), 4u);
}

INSTANTIATE_TEST_SUITE_P(GemmAndRowwise, ExpertGroupForwardTest,
                         ::testing::Values(int64_t{0}, kRowwiseLinearRowsWhenFaster),
                         [](const ::testing::TestParamInfo<int64_t>& info) {
                           return info.param == 0 ? std::string("Gemm") : std::string("Rowwise");
                         });

TEST(ExpertGroupTest, RejectsAGroupOrLayerOutsideTheShape) {
  const auto message = [](int group_id, int layer) {
    const absl::Status s = ExpertGroup::Create(Shape(), group_id, layer, kCpu).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    return std::string(s.message());
  };
  EXPECT_THAT(message(2, 0), HasSubstr("group_id: 2 is outside [0, 2)"));
  EXPECT_THAT(message(-1, 0), HasSubstr("group_id: -1 is outside [0, 2)"));
  EXPECT_THAT(message(0, 4), HasSubstr("layer 4 is outside [0, 4)"));
  v1::ExpertShape uneven = Shape();
  uneven.set_num_experts(7);
  EXPECT_THAT(std::string(ExpertGroup::Create(uneven, 0, 0, kCpu).status().message()),
              HasSubstr("num_experts (N=7) must be a multiple of num_groups (M=2)"));
}

TEST(ExpertGroupTest, CudaDeviceWhenAvailable) {
  if (!at::hasCUDA()) GTEST_SKIP() << "LibTorch has no CUDA on this machine";
  auto cpu = ExpertGroup::Create(Shape(), 0, 2, kCpu);
  auto gpu = ExpertGroup::Create(Shape(), 0, 2, c10::Device("cuda:0"));
  ASSERT_TRUE(cpu.ok() && gpu.ok());
  const at::Tensor rows = at::randn({5, 8});
  const at::Tensor ids = at::tensor({0, 1, 2, 1, 0}, at::kLong);
  auto a = (*cpu)->Forward(rows, ids);
  auto b = (*gpu)->Forward(rows, ids);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(at::allclose(*a, b->cpu(), 1e-4, 1e-5));
}

}  // namespace
}  // namespace himoe::expert
