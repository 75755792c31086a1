#ifndef HIMOE_TRAINER_DATA_H_
#define HIMOE_TRAINER_DATA_H_

// The trainer's data pipeline for a nanoGPT-style language model.
//
// Two formats:
//
// * "bytes": byte-level tokens (vocab 256), any text. Each path is a file or a
//   directory (walked recursively; symlinked directories are not descended).
//   The file set is then sorted by path string and filtered:
//     - files ending in ".dat" are skipped (fortune(6)'s binary index files);
//     - files with a NUL byte in their first 4 KiB are skipped (binary);
//     - duplicates are skipped: a file whose canonical path (symlinks
//       resolved) was already taken, and any "X.u8" whose sibling "X" exists
//       in the same directory (fortune(6) ships X.u8 as the UTF-8 copy of X;
//       in Debian it is a symlink to X). Sorting puts X before X.u8, so X is
//       the one kept.
//   Train/val split (deterministic): a file of n bytes puts its last
//   v = llround(n * val_fraction) bytes in val and its first n - v bytes in
//   train. The train parts are concatenated in sorted path order, likewise
//   the val parts; no separator is inserted between files.
//
// * "nanogpt": one directory holding train.bin and val.bin, each a flat array
//   of uint16 little-endian GPT-2 token ids (nanoGPT's prepare.py output). The
//   split is the two files. vocab_size() is 50304: GPT-2's 50257 padded up to
//   a multiple of 64, as nanoGPT does; ids must be < 50304.
//
// "auto": a single path that is a directory containing train.bin is nanogpt,
// anything else is bytes.
//
// The default corpus is Debian's `fortunes` package (/usr/share/games/fortunes).

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace himoe::trainer {

inline constexpr char kDefaultCorpusDir[] = "/usr/share/games/fortunes";
inline constexpr int64_t kByteVocabSize = 256;
inline constexpr int64_t kNanoGptVocabSize = 50304;  // 50257 padded to 64

// {kDefaultCorpusDir}. Corpus::Create reports a missing default corpus as
// NotFound with "install the fortunes package".
std::vector<std::string> DefaultCorpusPaths();

struct DataOptions {
  std::vector<std::string> paths;  // files or directories
  std::string format = "auto";     // "bytes" | "nanogpt" | "auto"
  double val_fraction = 0.1;       // bytes format only; in [0, 1)
};

enum class DataFormat { kBytes, kNanoGpt };
enum class Split { kTrain, kVal };

// A loaded corpus: two 1-D token tensors. Storage is uint8 for bytes and
// int32 for nanogpt (samplers return int64).
class Corpus {
 public:
  // InvalidArgument / NotFound naming the path on: a missing path, no text
  // files, an empty corpus (or empty train split), a nanogpt .bin with odd
  // length or out-of-vocabulary ids, a bad format or val_fraction.
  static absl::StatusOr<std::unique_ptr<Corpus>> Create(
      const DataOptions& options);

  DataFormat format() const { return format_; }
  const at::Tensor& train() const { return train_; }
  const at::Tensor& val() const { return val_; }
  const at::Tensor& split(Split s) const {
    return s == Split::kTrain ? train_ : val_;
  }
  int64_t vocab_size() const {
    return format_ == DataFormat::kBytes ? kByteVocabSize : kNanoGptVocabSize;
  }
  // Files whose tokens are in the corpus, in order.
  const std::vector<std::string>& files() const { return files_; }
  // Files seen but skipped (.dat, binary, duplicate), with the reason.
  const std::vector<std::string>& skipped() const { return skipped_; }
  // One line: format, file counts, total and per-split token counts.
  std::string Describe() const;

 private:
  Corpus() = default;

  DataFormat format_ = DataFormat::kBytes;
  std::vector<std::string> paths_;  // as given
  at::Tensor train_, val_;
  std::vector<std::string> files_;
  std::vector<std::string> skipped_;
};

// x and y are int64 [B, T]; y[b, t] = tokens[offsets[b] + t + 1] and
// x[b, t] = tokens[offsets[b] + t].
struct Batch {
  at::Tensor x, y;
  std::vector<int64_t> offsets;
};

struct BatchSamplerOptions {
  int64_t batch_size = 12;  // B
  int64_t block_size = 64;  // T
  uint64_t seed = 1337;
};

// Random training windows, as nanoGPT's get_batch: each offset is uniform in
// [0, n - T) (n = split length), drawn from the sampler's own mt19937_64
// (never the global torch RNG) by rejection sampling on raw 64-bit draws, so
// the sequence is the same with any standard library.
class BatchSampler {
 public:
  // InvalidArgument if B or T < 1 or the split has fewer than T + 1 tokens.
  // `tokens` is a 1-D corpus split (shared, not copied).
  static absl::StatusOr<std::unique_ptr<BatchSampler>> Create(
      const at::Tensor& tokens, const BatchSamplerOptions& options);

  Batch Next();
  // Draws the batch Next() would, without reading its windows (another
  // trainer rank's share of the sequence).
  void Skip();

  int64_t batches_drawn() const { return batches_drawn_; }
  const BatchSamplerOptions& options() const { return options_; }

  // Text holding B, T, n, the seed, batches_drawn and the mt19937_64 state.
  std::string SerializeState() const;
  // Restores a SerializeState() result; InvalidArgument if malformed or if
  // B, T or n differ from this sampler's (the sequence would not match).
  // Leaves the sampler unchanged on error.
  absl::Status RestoreState(const std::string& state);

 private:
  BatchSampler(const at::Tensor& tokens, const BatchSamplerOptions& options)
      : tokens_(tokens), options_(options), rng_(options.seed) {}
  std::vector<int64_t> DrawOffsets();

  at::Tensor tokens_;
  BatchSamplerOptions options_;
  std::mt19937_64 rng_;
  int64_t batches_drawn_ = 0;
};

struct EvalOptions {
  int64_t batch_size = 12;  // B
  int64_t block_size = 64;  // T
  int64_t max_windows = 0;  // K; 0 = every full window of the split
};

// Fixed validation windows, the same for every step and run: window i has
// offset i * T (non-overlapping), for i < K = min(max_windows, (n - 1) / T).
// Batches hold B consecutive windows; the last one may hold fewer.
class EvalWindows {
 public:
  // InvalidArgument if B or T < 1, max_windows < 0, or the split has fewer
  // than T + 1 tokens.
  static absl::StatusOr<std::unique_ptr<EvalWindows>> Create(
      const at::Tensor& tokens, const EvalOptions& options);

  int64_t num_windows() const { return num_windows_; }
  int64_t num_batches() const {
    return (num_windows_ + options_.batch_size - 1) / options_.batch_size;
  }
  // Batch i in [0, num_batches()).
  Batch GetBatch(int64_t i) const;

  // Iteration: Next fills `batch` and returns true until the windows run out.
  void Reset() { next_ = 0; }
  bool Next(Batch* batch);

 private:
  EvalWindows(const at::Tensor& tokens, const EvalOptions& options,
              int64_t num_windows)
      : tokens_(tokens), options_(options), num_windows_(num_windows) {}

  at::Tensor tokens_;
  EvalOptions options_;
  int64_t num_windows_;
  int64_t next_ = 0;
};

// Byte tokens to text (for generation). Ids outside [0, 256) become '?'.
std::string DecodeBytes(const std::vector<int64_t>& ids);

}  // namespace himoe::trainer

#endif  // HIMOE_TRAINER_DATA_H_
