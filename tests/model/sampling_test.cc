#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include "model/generator.h"

namespace himoe::model {
namespace {

GenerateParams Sampling(double temperature, int top_k, double top_p = 1.0) {
  GenerateParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  return p;
}

// The frequencies of `n` draws against hand-computed probabilities `want`
// (tokens of probability 0 must never come), within 5 standard errors.
void ExpectFrequencies(const at::Tensor& logits, const GenerateParams& p,
                       const std::vector<double>& want, uint64_t seed) {
  const int n = 60000;
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<int> count(want.size(), 0);
  for (int i = 0; i < n; ++i) {
    const absl::StatusOr<int64_t> t = SampleToken(logits, p, rng);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_GE(*t, 0);
    ASSERT_LT(*t, static_cast<int64_t>(want.size()));
    ++count[*t];
  }
  for (size_t j = 0; j < want.size(); ++j) {
    if (want[j] == 0) {
      EXPECT_EQ(count[j], 0) << "token " << j;
      continue;
    }
    const double freq = static_cast<double>(count[j]) / n;
    EXPECT_NEAR(freq, want[j], 5 * std::sqrt(want[j] * (1 - want[j]) / n)) << "token " << j;
  }
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

// Nucleus sampling by hand. softmax of {1.0, -0.5, 2.0, 0.2, 1.5, -3.0}:
// e^2 / Z = 0.4487, e^1.5 / Z = 0.2722, e^1 / Z = 0.1651, then 0.0742, 0.0368,
// 0.0030 (Z = 16.467). top_p 0.8: 0.4487 + 0.2722 = 0.7209 < 0.8 <= 0.8860
// with 1.0, so 2.0, 1.5 and 1.0 stay in, renormalized. With top_k 2 first, the
// nucleus is taken within the two: e^2 / (e^2 + e^1.5) = 0.6225 < 0.8, so
// both stay. top_p 0.4 keeps the argmax alone (0.4487 >= 0.4).
TEST(SampleTokenTest, TopPKeepsTheSmallestMostLikelySetReachingIt) {
  const std::vector<float> l = {1.0f, -0.5f, 2.0f, 0.2f, 1.5f, -3.0f};
  const at::Tensor logits = at::tensor(l);
  const double e2 = std::exp(2.0), e15 = std::exp(1.5), e1 = std::exp(1.0);
  const double z3 = e2 + e15 + e1;
  ExpectFrequencies(logits, Sampling(1.0, 0, 0.8), {e1 / z3, 0, e2 / z3, 0, e15 / z3, 0}, 11);
  ExpectFrequencies(logits, Sampling(1.0, 2, 0.8), {0, 0, e2 / (e2 + e15), 0, e15 / (e2 + e15), 0},
                    12);
  ExpectFrequencies(logits, Sampling(1.0, 0, 0.4), {0, 0, 1, 0, 0, 0}, 13);
  // Temperature first: at T = 0.5 the weights are e^(2(l - 2)): 2.0 alone is
  // 1 / (1 + e^-1 + e^-2 + ...) = 0.6505 >= 0.6, so only it stays.
  ExpectFrequencies(logits, Sampling(0.5, 0, 0.6), {0, 0, 1, 0, 0, 0}, 14);
}

// Ties with the last token kept stay in (as ties with the k-th for top_k):
// {1, 1, 0} has probabilities 0.4223, 0.4223, 0.1554; top_p 0.3 is reached by
// the first 1, and the other 1 stays too.
TEST(SampleTokenTest, TopPKeepsTiesWithTheLastTokenIn) {
  ExpectFrequencies(at::tensor({1.0f, 1.0f, 0.0f}), Sampling(1.0, 0, 0.3), {0.5, 0.5, 0}, 21);
}

}  // namespace
}  // namespace himoe::model
