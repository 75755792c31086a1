#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include "model/generator.h"

namespace himoe::model {
namespace {

GenerateParams Sampling(double temperature, int top_k) {
  GenerateParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  return p;
}

int64_t Draw(const at::Tensor& logits, const GenerateParams& p, at::Generator& rng) {
  const absl::StatusOr<int64_t> token = SampleToken(logits, p, rng);
  EXPECT_TRUE(token.ok()) << token.status();
  return token.ok() ? *token : -1;
}

// Temperature 0 is the argmax, the first of equal maxima; top-1 and
// temperatures so small that logits / T overflow are the argmax too (of
// logits with one maximum: top-1 keeps the ties with the first).
TEST(SampleTokenTest, GreedyLimitsAreTheArgmax) {
  const at::Tensor logits = at::tensor({0.5f, 2.0f, -1.0f, 2.0f, 1.9999f});
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(1);
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(Draw(logits, Sampling(0, 0), rng), 1);
    EXPECT_EQ(Draw(logits.narrow(0, 2, 3), Sampling(1.0, 1), rng), 1);
    EXPECT_EQ(Draw(logits.narrow(0, 2, 3), Sampling(1e-45, 0), rng), 1);
  }
}

// The frequencies of 60,000 draws are softmax(logits / T) over the top k
// (hand-computed here), within 5 standard errors; tokens outside the top k
// never come. The same seed gives the same draws, another seed others.
TEST(SampleTokenTest, DrawsFollowTheTemperedTopKSoftmax) {
  const std::vector<float> l = {1.0f, -0.5f, 2.0f, 0.2f, 1.5f, -3.0f};
  const at::Tensor logits = at::tensor(l);
  const double T = 0.7;
  const int k = 4;  // keeps 2.0, 1.5, 1.0, 0.2
  std::vector<double> p(l.size(), 0.0);
  double total = 0;
  for (size_t j = 0; j < l.size(); ++j) {
    if (l[j] >= 0.2f) total += p[j] = std::exp((l[j] - 2.0) / T);
  }
  for (double& v : p) v /= total;
  const int N = 60000;
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<int> count(l.size(), 0);
  std::vector<int64_t> first;
  for (int i = 0; i < N; ++i) {
    const int64_t t = Draw(logits, Sampling(T, k), rng);
    ASSERT_GE(t, 0);
    ASSERT_LT(t, static_cast<int64_t>(l.size()));
    ++count[t];
    if (i < 64) first.push_back(t);
  }
  for (size_t j = 0; j < l.size(); ++j) {
    const double freq = static_cast<double>(count[j]) / N;
    EXPECT_NEAR(freq, p[j], 5 * std::sqrt(p[j] * (1 - p[j]) / N) + 1e-12) << "token " << j;
  }
  EXPECT_EQ(count[1], 0);
  EXPECT_EQ(count[5], 0);
  for (const int seed : {7, 8}) {
    at::Generator again = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<int64_t> draws;
    for (int i = 0; i < 64; ++i) draws.push_back(Draw(logits, Sampling(T, k), again));
    if (seed == 7) {
      EXPECT_EQ(draws, first);
    } else {
      EXPECT_NE(draws, first);
    }
  }
}

}  // namespace
}  // namespace himoe::model
