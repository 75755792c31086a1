#ifndef HIMOE_MODEL_TEXT_GENERATOR_H_
#define HIMOE_MODEL_TEXT_GENERATOR_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"

namespace himoe::model {

struct GenerateParams {
  std::vector<int64_t> prompt;  // token ids, at least one
  int max_new_tokens = 64;
  double temperature = 1.0;  // 0 = greedy
  int top_k = 0;             // 0 = the whole vocabulary
  uint64_t seed = 0;
};

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

}  // namespace himoe::model

#endif  // HIMOE_MODEL_TEXT_GENERATOR_H_
