#include "model/text_generator.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace himoe::model {

absl::Status ValidateGenerateParams(const GenerateParams& params,
                                    const TextGenerator& generator) {
  if (params.prompt.empty()) {
    return absl::InvalidArgumentError(
        "prompt: empty; send at least one byte (prompt) or token id (prompt_tokens)");
  }
  const int64_t vocab = generator.vocab_size();
  for (size_t i = 0; i < params.prompt.size(); ++i) {
    if (params.prompt[i] < 0 || params.prompt[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_tokens[", i, "]: ", params.prompt[i],
                                                     " is not a token id in [0, ", vocab, ")"));
    }
  }
  const int limit = generator.max_new_tokens_limit();
  if (params.max_new_tokens < 1 || params.max_new_tokens > limit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens: expected 1 to ", limit, ", got ", params.max_new_tokens));
  }
  if (!std::isfinite(params.temperature) || params.temperature < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "temperature: expected a finite value >= 0 (0 = greedy), got ", params.temperature));
  }
  if (params.top_k < 0 || params.top_k > vocab) {
    return absl::InvalidArgumentError(absl::StrCat("top_k: expected 0 (off) to the vocab size ",
                                                   vocab, ", got ", params.top_k));
  }
  return absl::OkStatus();
}

}  // namespace himoe::model
