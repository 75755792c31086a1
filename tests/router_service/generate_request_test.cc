// DecodeGenerateRequest: the wire's GenerateRequest into GenerateParams, for
// byte-level models and models of another vocab.
#include <cstdint>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "himoe/v1/router.pb.h"
#include "model/text_generator.h"
#include "router_service/router_grpc_service.h"

namespace himoe::router {
namespace {

using ::testing::HasSubstr;

class VocabOnly : public model::TextGenerator {
 public:
  explicit VocabOnly(int64_t vocab) : vocab_(vocab) {}
  int64_t vocab_size() const override { return vocab_; }
  bool byte_level() const override { return vocab_ == 256; }
  int max_new_tokens_limit() const override { return 100; }
  absl::Status Generate(const model::GenerateParams&,
                        const std::function<bool(int64_t)>&) override {
    return absl::UnimplementedError("not sampled here");
  }

 private:
  int64_t vocab_;
};

v1::GenerateRequest Tokens(std::vector<int64_t> prompt) {
  v1::GenerateRequest r;
  for (const int64_t t : prompt) r.add_prompt_tokens(t);
  r.set_max_new_tokens(8);
  r.set_temperature(1.0f);
  return r;
}

TEST(DecodeGenerateRequestTest, StopBytesAreUnsignedTokensAndIdsOneTokenStops) {
  const VocabOnly bytes(256);
  v1::GenerateRequest r = Tokens({65});
  r.add_stop(std::string("\xff\x00\n", 3));
  r.add_stop_token_ids(7);
  r.set_top_p(0.5f);
  const auto p = DecodeGenerateRequest(r, bytes);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->stop, (std::vector<std::vector<int64_t>>{{255, 0, 10}, {7}}));
  EXPECT_EQ(p->top_p, 0.5);
  r.clear_top_p();  // proto3's unset 0 is off
  EXPECT_EQ(DecodeGenerateRequest(r, bytes)->top_p, 1.0);
}

TEST(DecodeGenerateRequestTest, OtherVocabsTakeStopTokenIdsNotStopBytes) {
  const VocabOnly words(1000);
  v1::GenerateRequest r = Tokens({998, 3});
  r.add_stop_token_ids(999);
  const auto p = DecodeGenerateRequest(r, words);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->stop, (std::vector<std::vector<int64_t>>{{999}}));

  v1::GenerateRequest bad = Tokens({1});
  bad.add_stop_token_ids(1000);
  EXPECT_THAT(DecodeGenerateRequest(bad, words).status().message(),
              HasSubstr("stop_token_ids[0]: 1000 is not a token id in [0, 1000)"));
  bad = Tokens({1});
  bad.add_stop("x");
  const absl::Status s = DecodeGenerateRequest(bad, words).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("stop: this model is not byte-level"));
  bad = Tokens({});
  bad.set_prompt("text");
  EXPECT_THAT(DecodeGenerateRequest(bad, words).status().message(),
              HasSubstr("prompt: this model is not byte-level"));
}

}  // namespace
}  // namespace himoe::router
