#include "common/matmul.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace himoe {
namespace {

// bfloat16 by hand: the float's top 16 bits, rounded to nearest, ties to even.
float RoundToBf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  bits &= 0xFFFF0000u;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

at::Tensor Rounded(const at::Tensor& t) {
  at::Tensor r = t.contiguous().clone();
  float* p = r.data_ptr<float>();
  for (int64_t i = 0; i < r.numel(); ++i) p[i] = RoundToBf16(p[i]);
  return r.view(t.sizes());
}

// beta * c + a b with a, b rounded by hand and summed in double; and the sum
// of |a_ik b_kj| (the scale of float32's rounding error in each sum).
struct Expected {
  at::Tensor value, scale;
};
Expected Oracle(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, double beta) {
  const at::Tensor ra = Rounded(a).to(at::kDouble), rb = Rounded(b).to(at::kDouble);
  return {beta * c.to(at::kDouble) + at::mm(ra, rb), at::mm(ra.abs(), rb.abs())};
}

// Both paths: oneDNN's bf16 GEMM (where this CPU has one) and the rounded
// operands through the float32 GEMM.
class MatmulBf16Test : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { SetBf16GemmNativeEnabled(GetParam()); }
  void TearDown() override { SetBf16GemmNativeEnabled(true); }
};

TEST_P(MatmulBf16Test, RoundsTheOperandsAndSumsInFloat32) {
  if (GetParam() && !Bf16GemmNative()) GTEST_SKIP() << "no oneDNN bf16 GEMM on this CPU";
  at::manual_seed(11);
  // Plain, transposed-in-memory and narrowed operands, with and without beta.
  const at::Tensor a_rows = at::randn({37, 200}), a_cols = at::randn({200, 40}).t().narrow(0, 1, 37);
  const at::Tensor b_rows = at::randn({210, 29}).narrow(0, 5, 200), b_cols = at::randn({29, 200}).t();
  for (const at::Tensor& a : {a_rows, a_cols}) {
    for (const at::Tensor& b : {b_rows, b_cols}) {
      for (const float beta : {0.0f, 1.0f}) {
        SCOPED_TRACE(testing::Message() << "a strides " << a.strides() << ", b strides "
                                        << b.strides() << ", beta " << beta);
        const at::Tensor start = at::randn({37, 29});
        at::Tensor out = start.clone();
        MatmulBf16Out(out, a, b, beta);
        const Expected want = Oracle(a, b, start, beta);
        const at::Tensor err = (out.to(at::kDouble) - want.value).abs();
        // float32 sums of exact products: within a few ulps of the sum of |terms|.
        EXPECT_TRUE(err.le(1e-6 * want.scale + 1e-6).all().item<bool>())
            << "max error " << err.max().item<double>();
        // Unrounded operands land about 2^-9 of the scale away: the rounding happened.
        const at::Tensor f32 = beta * start.to(at::kDouble) + at::mm(a.to(at::kDouble),
                                                                      b.to(at::kDouble));
        EXPECT_GT((out.to(at::kDouble) - f32).abs().max().item<double>(), 1e-3);
      }
    }
  }
}

TEST_P(MatmulBf16Test, Bf16OperandsAreTakenAsTheyAre) {
  at::manual_seed(12);
  const at::Tensor a = at::randn({16, 64}), b = at::randn({64, 8});
  at::Tensor out = at::empty({16, 8});
  MatmulBf16Out(out, a.to(at::kBFloat16), b.t().contiguous().to(at::kBFloat16).t(), 0.0f);
  const Expected want = Oracle(a, b, at::zeros({16, 8}), 0.0);
  EXPECT_TRUE((out.to(at::kDouble) - want.value).abs().le(1e-6 * want.scale + 1e-6).all()
                  .item<bool>());
}

INSTANTIATE_TEST_SUITE_P(Paths, MatmulBf16Test, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "OneDnn" : "Rounded"; });

TEST(MatmulBf16RefusalTest, RefusesOtherShapesAndDtypes) {
  at::Tensor out = at::empty({4, 3});
  EXPECT_THROW(MatmulBf16Out(out, at::randn({4, 5}), at::randn({6, 3}), 0.0f), c10::Error);
  at::Tensor out_int = at::empty({4, 3}, at::kInt);
  EXPECT_THROW(MatmulBf16Out(out_int, at::randn({4, 5}), at::randn({5, 3}), 0.0f), c10::Error);
  EXPECT_THROW(MatmulBf16Out(out, at::randn({4, 5}, at::kDouble), at::randn({5, 3}), 0.0f),
               c10::Error);
}

// y = x W^T + b and, for the loss sum(y * g), gx = g W, gW = g^T x, gb = sum g,
// each product on rounded operands (g too), in double.
TEST(LinearBf16Test, ValuesAndGradientsAreProductsOfRoundedOperands) {
  at::manual_seed(13);
  for (const bool with_bias : {true, false}) {
    SCOPED_TRACE(with_bias ? "bias" : "no bias");
    const at::Tensor x0 = at::randn({2, 5, 64}), w0 = at::randn({24, 64}), b0 = at::randn({24});
    const at::Tensor g = at::randn({2, 5, 24});
    const at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    const at::Tensor b = with_bias ? b0.clone().requires_grad_(true) : at::Tensor();
    const at::Tensor y = LinearBf16(x, w, b);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 5, 24}));
    (y * g).sum().backward();

    const at::Tensor rx = Rounded(x0).view({10, 64}).to(at::kDouble);
    const at::Tensor rw = Rounded(w0).to(at::kDouble);
    const at::Tensor rg = Rounded(g).view({10, 24}).to(at::kDouble);
    const auto close = [](const at::Tensor& got, const at::Tensor& want, const at::Tensor& scale) {
      return (got.to(at::kDouble).reshape(want.sizes()) - want).abs().le(1e-6 * scale + 1e-6)
          .all().item<bool>();
    };
    at::Tensor want_y = at::mm(rx, rw.t());
    if (with_bias) want_y = want_y + b0.to(at::kDouble);
    EXPECT_TRUE(close(y, want_y, at::mm(rx.abs(), rw.abs().t()) + 1));
    EXPECT_TRUE(close(x.grad(), at::mm(rg, rw), at::mm(rg.abs(), rw.abs())));
    EXPECT_TRUE(close(w.grad(), at::mm(rg.t(), rx), at::mm(rg.abs().t(), rx.abs())));
    if (with_bias) {
      EXPECT_TRUE(at::allclose(b.grad(), g.view({10, 24}).sum(0), 1e-5, 1e-5));
    }
  }
}

}  // namespace
}  // namespace himoe
