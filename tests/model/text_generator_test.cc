#include "model/text_generator.h"

#include <cstdint>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"

namespace himoe::model {
namespace {

using ::testing::HasSubstr;

std::vector<int64_t> Tokens(const std::string& s) {
  return std::vector<int64_t>(s.begin(), s.end());
}

// Feeds `sampled` one token at a time; returns what was emitted, and where the
// stream stopped (-1: it did not), then the held tokens flushed at the end.
struct Fed {
  std::string emitted;
  int stopped_at = -1;
  std::string flushed;
};

Fed Feed(const std::vector<std::string>& stop, const std::string& sampled) {
  std::vector<std::vector<int64_t>> seqs;
  for (const std::string& s : stop) seqs.push_back(Tokens(s));
  StopMatcher m(seqs);
  Fed f;
  for (size_t i = 0; i < sampled.size(); ++i) {
    std::vector<int64_t> out;
    const bool stop_here = m.Feed(static_cast<unsigned char>(sampled[i]), &out);
    f.emitted += std::string(out.begin(), out.end());
    if (stop_here) {
      f.stopped_at = static_cast<int>(i);
      return f;
    }
  }
  const std::vector<int64_t> rest = m.Flush();
  f.flushed = std::string(rest.begin(), rest.end());
  return f;
}

TEST(StopMatcherTest, EmitsWhatPrecedesTheStopAndNothingOfIt) {
  const Fed f = Feed({"END"}, "abcENDxyz");
  EXPECT_EQ(f.emitted, "abc");
  EXPECT_EQ(f.stopped_at, 5);
}

TEST(StopMatcherTest, HoldsAPossibleStartAndReleasesItWhenItDiverges) {
  // "EN" may begin "END": held; 'x' breaks it, so "ENx" goes out.
  Fed f = Feed({"END"}, "abEN");
  EXPECT_EQ(f.emitted, "ab");
  EXPECT_EQ(f.stopped_at, -1);
  EXPECT_EQ(f.flushed, "EN");  // the stream ended by length: held tokens are sent
  f = Feed({"END"}, "abENxEND");
  EXPECT_EQ(f.emitted, "abENx");
  EXPECT_EQ(f.stopped_at, 7);
}

TEST(StopMatcherTest, AMatchMayStartInsideAnAbandonedPrefix) {
  // "aab" with stop "ab": the first 'a' is released once "aa" cannot begin
  // "ab", the second stays held, and "ab" matches.
  Fed f = Feed({"ab"}, "aab");
  EXPECT_EQ(f.emitted, "a");
  EXPECT_EQ(f.stopped_at, 2);
  // "ababc" with stop "abc": after "abab" the suffix "ab" is kept.
  f = Feed({"abc"}, "ababc");
  EXPECT_EQ(f.emitted, "ab");
  EXPECT_EQ(f.stopped_at, 4);
}

TEST(StopMatcherTest, TheEarliestStartingMatchWins) {
  // Both "xbc" and "bc" end at 'c'; the text is cut before the longer one.
  const Fed f = Feed({"bc", "xbc"}, "axbc");
  EXPECT_EQ(f.emitted, "a");
  EXPECT_EQ(f.stopped_at, 3);
}

TEST(StopMatcherTest, OneTokenStopsAndNoStops) {
  Fed f = Feed({"\n"}, "one\ntwo");
  EXPECT_EQ(f.emitted, "one");
  EXPECT_EQ(f.stopped_at, 3);
  f = Feed({}, "one\ntwo");
  EXPECT_EQ(f.emitted, "one\ntwo");
  EXPECT_EQ(f.stopped_at, -1);
  EXPECT_EQ(f.flushed, "");
}

// A generator that samples a fixed text, as the TextGenerator contract says:
// max_new_tokens tokens, Cancelled when on_token returns false.
class ScriptedGenerator : public TextGenerator {
 public:
  explicit ScriptedGenerator(std::string text) : text_(std::move(text)) {}
  int64_t vocab_size() const override { return 256; }
  bool byte_level() const override { return true; }
  int max_new_tokens_limit() const override { return 100; }
  absl::Status Generate(const GenerateParams& params,
                        const std::function<bool(int64_t)>& on_token) override {
    for (int i = 0; i < params.max_new_tokens; ++i) {
      ++sampled;
      if (!on_token(static_cast<unsigned char>(text_[i % text_.size()]))) {
        return absl::CancelledError("stopped by the caller");
      }
    }
    return absl::OkStatus();
  }
  int sampled = 0;

 private:
  std::string text_;
};

struct Sampled {
  absl::StatusOr<FinishReason> finish;
  std::string text;
};

Sampled Generate(ScriptedGenerator& g, int n, const std::vector<std::string>& stop, int emit_limit) {
  GenerateParams p;
  p.prompt = {65};
  p.max_new_tokens = n;
  for (const std::string& s : stop) p.stop.push_back(Tokens(s));
  Sampled r;
  r.finish = GenerateUntilStop(g, p, [&](int64_t t) {
    r.text += static_cast<char>(t);
    return static_cast<int>(r.text.size()) < emit_limit;
  });
  return r;
}

TEST(GenerateUntilStopTest, EndsAtTheStopWithoutSamplingFurther) {
  ScriptedGenerator g("Hello, world. More text.");
  const Sampled r = Generate(g, 20, {". "}, 1000);
  ASSERT_TRUE(r.finish.ok()) << r.finish.status();
  EXPECT_EQ(*r.finish, FinishReason::kStop);
  EXPECT_EQ(r.text, "Hello, world");
  EXPECT_EQ(g.sampled, 14);  // "Hello, world. " and no more
  EXPECT_STREQ(FinishReasonName(*r.finish), "stop");
}

TEST(GenerateUntilStopTest, LengthSendsTheHeldTokens) {
  ScriptedGenerator g("Hello, world. More text.");
  const Sampled r = Generate(g, 13, {". "}, 1000);  // ends on the '.' that may begin ". "
  ASSERT_TRUE(r.finish.ok()) << r.finish.status();
  EXPECT_EQ(*r.finish, FinishReason::kLength);
  EXPECT_EQ(r.text, "Hello, world.");
  EXPECT_STREQ(FinishReasonName(*r.finish), "length");
}

TEST(GenerateUntilStopTest, ACallerThatStopsReadingIsCancelled) {
  ScriptedGenerator g("abcdef");
  const Sampled r = Generate(g, 6, {}, 3);
  EXPECT_EQ(r.finish.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(r.text, "abc");
  EXPECT_EQ(g.sampled, 3);
}

TEST(ValidateGenerateParamsTest, TopPAndStopAreCheckedNamingTheField) {
  ScriptedGenerator g("x");
  GenerateParams ok;
  ok.prompt = {1};
  ok.top_p = 0.9;
  ok.stop = {{1, 2}, {255}};
  EXPECT_TRUE(ValidateGenerateParams(ok, g).ok());
  const auto error = [&](auto mutate) {
    GenerateParams p = ok;
    mutate(p);
    const absl::Status s = ValidateGenerateParams(p, g);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    return std::string(s.message());
  };
  for (const double bad : {0.0, -0.1, 1.5, std::nan("")}) {
    EXPECT_THAT(error([&](GenerateParams& p) { p.top_p = bad; }), HasSubstr("top_p")) << bad;
  }
  EXPECT_THAT(error([](GenerateParams& p) { p.stop.push_back({}); }), HasSubstr("stop[2]"));
  EXPECT_THAT(error([](GenerateParams& p) { p.stop[1] = {256}; }), HasSubstr("stop[1]"));
  EXPECT_THAT(error([](GenerateParams& p) { p.stop[0] = std::vector<int64_t>(65, 1); }),
              HasSubstr("stop[0]"));
  EXPECT_THAT(error([](GenerateParams& p) { p.stop.resize(17, {1}); }), HasSubstr("at most 16"));
}

}  // namespace
}  // namespace himoe::model
