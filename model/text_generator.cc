#include "model/text_generator.h"

#include <algorithm>
#include <cmath>
#include <utility>

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
  if (!std::isfinite(params.top_p) || params.top_p <= 0 || params.top_p > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_p: expected a value in (0, 1] (1 = off), got ", params.top_p));
  }
  if (params.stop.size() > static_cast<size_t>(kMaxStopSequences)) {
    return absl::InvalidArgumentError(absl::StrCat("stop: at most ", kMaxStopSequences,
                                                   " stop sequences, got ", params.stop.size()));
  }
  for (size_t i = 0; i < params.stop.size(); ++i) {
    const std::vector<int64_t>& seq = params.stop[i];
    if (seq.empty() || seq.size() > static_cast<size_t>(kMaxStopTokens)) {
      return absl::InvalidArgumentError(absl::StrCat("stop[", i, "]: expected 1 to ",
                                                     kMaxStopTokens, " tokens, got ", seq.size()));
    }
    for (const int64_t t : seq) {
      if (t < 0 || t >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat(
            "stop[", i, "]: ", t, " is not a token id in [0, ", vocab, ")"));
      }
    }
  }
  return absl::OkStatus();
}

StopMatcher::StopMatcher(std::vector<std::vector<int64_t>> stop) : stop_(std::move(stop)) {}

bool StopMatcher::Feed(int64_t token, std::vector<int64_t>* emit) {
  held_.push_back(token);
  const auto ends_with = [&](const std::vector<int64_t>& seq) {
    return seq.size() <= held_.size() && std::equal(seq.rbegin(), seq.rend(), held_.rbegin());
  };
  // A match ends here only if its start lies within held_: the part before
  // this token was a proper prefix, so it was held.
  size_t longest = 0;
  for (const auto& seq : stop_) {
    if (ends_with(seq)) longest = std::max(longest, seq.size());
  }
  if (longest > 0) {
    emit->insert(emit->end(), held_.begin(), held_.end() - static_cast<std::ptrdiff_t>(longest));
    held_.clear();
    return true;
  }
  // Keep the longest suffix that a stop sequence begins with.
  size_t keep = 0;
  for (size_t n = held_.size(); n > 0 && keep == 0; --n) {
    for (const auto& seq : stop_) {
      if (n < seq.size() && std::equal(held_.end() - static_cast<std::ptrdiff_t>(n), held_.end(),
                                       seq.begin())) {
        keep = n;
        break;
      }
    }
  }
  const auto cut = held_.end() - static_cast<std::ptrdiff_t>(keep);
  emit->insert(emit->end(), held_.begin(), cut);
  held_.erase(held_.begin(), cut);
  return false;
}

std::vector<int64_t> StopMatcher::Flush() { return std::exchange(held_, {}); }

const char* FinishReasonName(FinishReason reason) {
  return reason == FinishReason::kStop ? "stop" : "length";
}

absl::StatusOr<FinishReason> GenerateUntilStop(TextGenerator& generator,
                                               const GenerateParams& params,
                                               const std::function<bool(int64_t)>& emit) {
  StopMatcher matcher(params.stop);
  bool stopped = false;
  bool cancelled = false;
  std::vector<int64_t> out;
  const absl::Status status = generator.Generate(params, [&](int64_t token) {
    out.clear();
    const bool stop = matcher.Feed(token, &out);
    for (const int64_t t : out) {
      if (!emit(t)) {
        cancelled = true;
        return false;
      }
    }
    stopped = stop;
    return !stop;
  });
  if (cancelled) return absl::CancelledError("generate: the caller stopped the stream");
  if (stopped) return FinishReason::kStop;  // the generator ended it as asked
  if (!status.ok()) return status;
  for (const int64_t t : matcher.Flush()) {
    if (!emit(t)) return absl::CancelledError("generate: the caller stopped the stream");
  }
  return FinishReason::kLength;
}

}  // namespace himoe::model
