#ifndef HIMOE_MODEL_TEXT_GENERATOR_H_
#define HIMOE_MODEL_TEXT_GENERATOR_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace himoe::model {

struct GenerateParams {
  std::vector<int64_t> prompt;  // token ids, at least one
  int max_new_tokens = 64;
  double temperature = 1.0;  // 0 = greedy
  int top_k = 0;             // 0 = the whole vocabulary
  // Nucleus sampling: the most likely tokens (after top_k) whose probability
  // first reaches top_p; 1 = off.
  double top_p = 1.0;
  uint64_t seed = 0;
  // The stream ends as soon as its sampled tokens end with one of these
  // (GenerateUntilStop); the stop sequence itself is not sent.
  std::vector<std::vector<int64_t>> stop;
};

// Bounds on GenerateParams::stop.
inline constexpr int kMaxStopSequences = 16;
inline constexpr int kMaxStopTokens = 64;

// Counters of a generator, for metrics.
struct GeneratorStats {
  int64_t tokens = 0;          // sampled so far, every stream
  int64_t steps = 0;           // decoding steps (each samples one token per stream)
  int64_t active_streams = 0;  // decoding now
  int64_t rejected = 0;        // requests refused: max_streams were decoding
  int64_t kv_cache_slots = 0;  // KV cache slots held by streams
};

// A language model the router can sample from (the trainer's checkpointed LM
// implements it; the router library does not depend on the trainer).
class TextGenerator {
 public:
  virtual ~TextGenerator() = default;

  virtual int64_t vocab_size() const = 0;
  // Whether token t is the byte t (a byte-level model).
  virtual bool byte_level() const = 0;
  // The most tokens one request may ask for.
  virtual int max_new_tokens_limit() const = 0;

  // Samples params.max_new_tokens tokens, calling `on_token` with each as soon
  // as it is drawn. Stops early with Cancelled when `on_token` returns false.
  // `params` must already be valid (ValidateGenerateParams).
  virtual absl::Status Generate(const GenerateParams& params,
                                const std::function<bool(int64_t)>& on_token) = 0;

  virtual GeneratorStats stats() const { return GeneratorStats(); }
};

// INVALID_ARGUMENT naming the field when `params` does not fit `generator`.
absl::Status ValidateGenerateParams(const GenerateParams& params, const TextGenerator& generator);

// Holds back the sampled tokens that may begin a stop sequence, so that a
// stop sequence is never sent, as a stop string in vLLM or OpenAI's API.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::vector<int64_t>> stop);

  // Takes the next sampled token; appends to `emit` the tokens now known to
  // lie before any stop sequence. True when the tokens so far end with a
  // stop sequence: the stream ends there, and of the held tokens only those
  // before the earliest-starting match are emitted.
  bool Feed(int64_t token, std::vector<int64_t>* emit);
  // The tokens still held (the stream ended without a stop).
  std::vector<int64_t> Flush();

 private:
  std::vector<std::vector<int64_t>> stop_;
  std::vector<int64_t> held_;  // the longest suffix that is a proper prefix of a stop sequence
};

enum class FinishReason { kLength, kStop };
const char* FinishReasonName(FinishReason reason);  // "length", "stop"

// generator.Generate with params.stop applied (StopMatcher): `emit` gets the
// tokens to send. Ends with kStop at a stop sequence, kLength after
// max_new_tokens; Cancelled when `emit` returns false.
absl::StatusOr<FinishReason> GenerateUntilStop(TextGenerator& generator,
                                               const GenerateParams& params,
                                               const std::function<bool(int64_t)>& emit);

}  // namespace himoe::model

#endif  // HIMOE_MODEL_TEXT_GENERATOR_H_
