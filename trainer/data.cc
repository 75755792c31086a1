#include "trainer/data.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <locale>
#include <set>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <torch/types.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"
#include "glog/logging.h"

namespace himoe::trainer {
namespace {

constexpr int64_t kBinarySniffBytes = 4096;
constexpr char kSamplerStateMagic[] = "himoe-batch-sampler-v1";

std::string MissingPathMessage(const std::string& path) {
  std::string msg = absl::StrCat("data path does not exist: ", path);
  if (absl::StartsWith(path, kDefaultCorpusDir)) {
    absl::StrAppend(&msg,
                    " (the default corpus: install the fortunes package, "
                    "apt-get install fortunes)");
  }
  return msg;
}

// Appends the regular files at `path` (a file, or a directory walked
// recursively) to `out`.
absl::Status CollectFiles(const std::string& path, std::vector<std::string>* out) {
  const PathKind kind = KindOf(path);
  if (kind == PathKind::kMissing) return absl::NotFoundError(MissingPathMessage(path));
  if (kind == PathKind::kFile) {
    out->push_back(path);
    return absl::OkStatus();
  }
  if (kind != PathKind::kDirectory) {
    return absl::InvalidArgumentError(
        absl::StrCat("data path is neither a file nor a directory: ", path));
  }
  absl::StatusOr<std::vector<std::string>> files = RegularFilesUnder(path);
  if (!files.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot ", files.status().message()));
  }
  out->insert(out->end(), files->begin(), files->end());
  return absl::OkStatus();
}

// Reads up to `n` bytes of `path` from `offset` into `dst`; returns the count.
absl::StatusOr<int64_t> ReadAt(const std::string& path, int64_t offset, int64_t n,
                               char* dst) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("cannot open ", path));
  }
  in.seekg(offset);
  in.read(dst, n);
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat("error reading ", path));
  }
  return static_cast<int64_t>(in.gcount());
}

// Reads exactly `n` bytes of `path` from `offset` into `dst`.
absl::Status ReadExactly(const std::string& path, int64_t offset, int64_t n,
                         char* dst) {
  HIMOE_ASSIGN_OR_RETURN(const int64_t got, ReadAt(path, offset, n, dst));
  if (got != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "short read of ", path, " (", got, " of ", n,
        " bytes at offset ", offset, "); did the file change?"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> SizeOf(const std::string& path) {
  absl::StatusOr<int64_t> size = FileSize(path);
  if (!size.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot ", size.status().message()));
  }
  return size;
}

bool IsNanoGptDir(const std::string& path) {
  return IsDirectory(path) && IsRegularFile(JoinPath(path, "train.bin"));
}

// One uint16 LE token file as an int32 tensor.
absl::StatusOr<at::Tensor> LoadTokenBin(const std::string& path) {
  if (!IsRegularFile(path)) {
    return absl::NotFoundError(absl::StrCat("nanogpt token file not found: ", path));
  }
  HIMOE_ASSIGN_OR_RETURN(const int64_t size, SizeOf(path));
  if (size % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": odd byte length ", size,
        "; expected uint16 little-endian token ids"));
  }
  const int64_t n = size / 2;
  at::Tensor tokens = at::empty({n}, at::dtype(at::kInt));
  int32_t* out = tokens.data_ptr<int32_t>();
  constexpr int64_t kChunkTokens = 1 << 20;
  std::vector<unsigned char> buf(2 * std::min(n, kChunkTokens));
  for (int64_t start = 0; start < n; start += kChunkTokens) {
    const int64_t count = std::min(kChunkTokens, n - start);
    HIMOE_RETURN_IF_ERROR(ReadExactly(path, 2 * start, 2 * count,
                                reinterpret_cast<char*>(buf.data())));
    for (int64_t i = 0; i < count; ++i) {
      const int32_t id = buf[2 * i] | (static_cast<int32_t>(buf[2 * i + 1]) << 8);
      if (id >= kNanoGptVocabSize) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": token id ", id, " at index ", start + i,
            " is outside the vocabulary [0, ", kNanoGptVocabSize, ")"));
      }
      out[start + i] = id;
    }
  }
  return tokens;
}

// Stacks the windows tokens[o, o + T] (T + 1 tokens each) into x and y.
Batch GatherWindows(const at::Tensor& tokens, std::vector<int64_t> offsets,
                    int64_t block_size) {
  std::vector<at::Tensor> rows;
  rows.reserve(offsets.size());
  for (const int64_t o : offsets) rows.push_back(tokens.narrow(0, o, block_size + 1));
  const at::Tensor w = at::stack(rows).to(at::kLong);
  Batch batch;
  batch.x = w.narrow(1, 0, block_size).contiguous();
  batch.y = w.narrow(1, 1, block_size).contiguous();
  batch.offsets = std::move(offsets);
  return batch;
}

absl::Status CheckWindowShape(const at::Tensor& tokens, int64_t batch_size,
                              int64_t block_size, const char* what) {
  if (batch_size < 1 || block_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": batch_size and block_size must be >= 1; got ",
                     batch_size, ", ", block_size));
  }
  if (!tokens.defined() || tokens.dim() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": tokens must be a 1-D tensor"));
  }
  if (tokens.numel() < block_size + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": split has ", tokens.numel(),
        " tokens, too short for block_size ", block_size, " (needs at least ",
        block_size + 1, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<DataFormat> ResolveFormat(const DataOptions& o) {
  if (o.paths.empty()) {
    return absl::InvalidArgumentError("data: no paths given");
  }
  if (o.format == "bytes") return DataFormat::kBytes;
  if (o.format == "nanogpt") return DataFormat::kNanoGpt;
  if (o.format != "auto") {
    return absl::InvalidArgumentError(absl::StrCat(
        "data: format must be bytes, nanogpt or auto; got '", o.format, "'"));
  }
  if (o.paths.size() == 1 && IsNanoGptDir(o.paths[0])) return DataFormat::kNanoGpt;
  if (o.paths.size() > 1) {
    for (const std::string& p : o.paths) {
      if (IsNanoGptDir(p)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "data: ", p, " holds train.bin (nanogpt format) and must be the "
            "only path"));
      }
    }
  }
  return DataFormat::kBytes;
}

// A corpus's two splits and the files they came from.
struct Splits {
  at::Tensor train, val;
  std::vector<std::string> files;
};

absl::StatusOr<Splits> LoadNanoGpt(const std::vector<std::string>& paths) {
  if (paths.size() != 1) {
    return absl::InvalidArgumentError(
        "data: nanogpt format takes exactly one directory");
  }
  const std::string& dir = paths[0];
  const PathKind kind = KindOf(dir);
  if (kind == PathKind::kMissing) return absl::NotFoundError(MissingPathMessage(dir));
  if (kind != PathKind::kDirectory) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data: nanogpt path must be a directory with train.bin and val.bin: ",
        dir));
  }
  Splits out;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    const std::string train_path = JoinPath(dir, "train.bin");
    const std::string val_path = JoinPath(dir, "val.bin");
    HIMOE_ASSIGN_OR_RETURN(out.train, LoadTokenBin(train_path));
    HIMOE_ASSIGN_OR_RETURN(out.val, LoadTokenBin(val_path));
    if (out.train.numel() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("data: empty corpus: ", train_path, " holds no tokens"));
    }
    out.files = {train_path, val_path};
    return absl::OkStatus();
  }));
  return out;
}

// A text file of a bytes corpus and how many of its bytes go to val.
struct TextFile {
  std::string path;
  int64_t size;
  int64_t val;
};

// Every file at o.paths, sorted, without duplicates; the reason a file is
// skipped (.dat index, .u8 copy, duplicate, binary) goes to `skipped`.
absl::StatusOr<std::vector<TextFile>> SelectTextFiles(const DataOptions& o,
                                                      std::vector<std::string>* skipped) {
  std::vector<std::string> candidates;
  for (const std::string& p : o.paths) HIMOE_RETURN_IF_ERROR(CollectFiles(p, &candidates));
  std::sort(candidates.begin(), candidates.end());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  std::vector<TextFile> taken;
  std::set<std::string> canonical_taken;
  for (const std::string& p : candidates) {
    const std::string name = Basename(p);
    if (absl::EndsWith(name, ".dat")) {
      skipped->push_back(absl::StrCat(p, " (.dat index)"));
      continue;
    }
    if (absl::EndsWith(name, ".u8") && name.size() > 3 &&
        IsRegularFile(JoinPath(Dirname(p), name.substr(0, name.size() - 3)))) {
      skipped->push_back(absl::StrCat(p, " (.u8 copy of a sibling)"));
      continue;
    }
    const absl::StatusOr<std::string> canonical = CanonicalPath(p);
    if (!canonical_taken.insert(canonical.ok() ? *canonical : p).second) {
      skipped->push_back(absl::StrCat(p, " (duplicate)"));
      continue;
    }
    HIMOE_ASSIGN_OR_RETURN(const int64_t size, SizeOf(p));
    std::string head(std::min(size, kBinarySniffBytes), '\0');
    HIMOE_ASSIGN_OR_RETURN(const int64_t got, ReadAt(p, 0, head.size(), head.data()));
    head.resize(got);
    if (head.find('\0') != std::string::npos) {
      skipped->push_back(absl::StrCat(p, " (binary)"));
      continue;
    }
    const int64_t val = std::min<int64_t>(
        size, std::llround(static_cast<double>(size) * o.val_fraction));
    taken.push_back({p, size, val});
  }
  return taken;
}

// The train parts of `files` concatenated in order, likewise the val parts.
absl::StatusOr<Splits> ReadByteSplits(const std::vector<TextFile>& files,
                                      const std::vector<std::string>& paths) {
  int64_t train_n = 0, val_n = 0;
  for (const TextFile& t : files) {
    train_n += t.size - t.val;
    val_n += t.val;
  }
  if (train_n == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data: empty corpus: ", files.size(), " file(s) in ",
        absl::StrJoin(paths, ", "), " hold ", train_n + val_n,
        " bytes, leaving no training bytes"));
  }
  Splits out;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&]() -> absl::Status {
    out.train = at::empty({train_n}, at::dtype(at::kByte));
    out.val = at::empty({val_n}, at::dtype(at::kByte));
    char* train_ptr = reinterpret_cast<char*>(out.train.data_ptr<uint8_t>());
    char* val_ptr = reinterpret_cast<char*>(out.val.data_ptr<uint8_t>());
    for (const TextFile& t : files) {
      const int64_t tn = t.size - t.val;
      HIMOE_RETURN_IF_ERROR(ReadExactly(t.path, 0, tn, train_ptr));
      HIMOE_RETURN_IF_ERROR(ReadExactly(t.path, tn, t.val, val_ptr));
      train_ptr += tn;
      val_ptr += t.val;
      out.files.push_back(t.path);
    }
    return absl::OkStatus();
  }));
  return out;
}

}  // namespace

std::vector<std::string> DefaultCorpusPaths() { return {kDefaultCorpusDir}; }

absl::StatusOr<std::unique_ptr<Corpus>> Corpus::Create(const DataOptions& o) {
  HIMOE_ASSIGN_OR_RETURN(const DataFormat format, ResolveFormat(o));
  std::unique_ptr<Corpus> corpus(new Corpus());
  corpus->format_ = format;
  corpus->paths_ = o.paths;
  Splits splits;
  if (format == DataFormat::kNanoGpt) {
    HIMOE_ASSIGN_OR_RETURN(splits, LoadNanoGpt(o.paths));
  } else {
    if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data: val_fraction must be in [0, 1); got ", o.val_fraction));
    }
    HIMOE_ASSIGN_OR_RETURN(const std::vector<TextFile> files,
                           SelectTextFiles(o, &corpus->skipped_));
    if (files.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data: no text files found in ", absl::StrJoin(o.paths, ", "), " (",
          corpus->skipped_.size(), " skipped: .dat index, binary or duplicate)"));
    }
    HIMOE_ASSIGN_OR_RETURN(splits, ReadByteSplits(files, o.paths));
  }
  corpus->train_ = std::move(splits.train);
  corpus->val_ = std::move(splits.val);
  corpus->files_ = std::move(splits.files);
  if (format == DataFormat::kBytes) VLOG(1) << corpus->Describe();
  return corpus;
}

std::string Corpus::Describe() const {
  const int64_t train_n = train_.numel(), val_n = val_.numel();
  if (format_ == DataFormat::kNanoGpt) {
    return absl::StrCat("nanogpt corpus ", absl::StrJoin(paths_, ", "),
                        ": train ", train_n, " tokens, val ", val_n,
                        " tokens, vocab ", vocab_size());
  }
  return absl::StrCat("bytes corpus ", absl::StrJoin(paths_, ", "), ": ",
                      files_.size(), " files (", skipped_.size(),
                      " skipped), ", train_n + val_n, " bytes; train ",
                      train_n, ", val ", val_n, "; vocab ", vocab_size());
}

absl::StatusOr<std::unique_ptr<BatchSampler>> BatchSampler::Create(
    const at::Tensor& tokens, const BatchSamplerOptions& options) {
  HIMOE_RETURN_IF_ERROR(CheckWindowShape(tokens, options.batch_size,
                                   options.block_size, "batch sampler"));
  return std::unique_ptr<BatchSampler>(new BatchSampler(tokens, options));
}

Batch BatchSampler::Next() { return GatherWindows(tokens_, DrawOffsets(), options_.block_size); }

void BatchSampler::Skip() { DrawOffsets(); }

std::vector<int64_t> BatchSampler::DrawOffsets() {
  // Uniform in [0, range) by rejection: drop the low 2^64 mod range draws.
  const uint64_t range =
      static_cast<uint64_t>(tokens_.numel() - options_.block_size);
  const uint64_t threshold = (0 - range) % range;
  std::vector<int64_t> offsets(options_.batch_size);
  for (int64_t& off : offsets) {
    uint64_t r;
    do {
      r = rng_();
    } while (r < threshold);
    off = static_cast<int64_t>(r % range);
  }
  ++batches_drawn_;
  return offsets;
}

std::string BatchSampler::SerializeState() const {
  std::ostringstream os;
  os.imbue(std::locale::classic());
  os << kSamplerStateMagic << ' ' << options_.batch_size << ' '
     << options_.block_size << ' ' << tokens_.numel() << ' ' << options_.seed
     << ' ' << batches_drawn_ << ' ' << rng_;
  return os.str();
}

absl::Status BatchSampler::RestoreState(const std::string& state) {
  std::istringstream is(state);
  is.imbue(std::locale::classic());
  std::string magic;
  int64_t batch_size = 0, block_size = 0, n = 0, drawn = 0;
  uint64_t seed = 0;
  std::mt19937_64 rng;
  is >> magic >> batch_size >> block_size >> n >> seed >> drawn >> rng;
  if (is.fail() || magic != kSamplerStateMagic || drawn < 0) {
    return absl::InvalidArgumentError(
        "batch sampler: malformed state (expected SerializeState() output)");
  }
  is >> std::ws;
  if (!is.eof()) {
    return absl::InvalidArgumentError(
        "batch sampler: trailing data after the state");
  }
  if (batch_size != options_.batch_size || block_size != options_.block_size ||
      n != tokens_.numel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch sampler: state is for batch_size ", batch_size, ", block_size ",
        block_size, ", ", n, " tokens; this sampler has ", options_.batch_size,
        ", ", options_.block_size, ", ", tokens_.numel()));
  }
  options_.seed = seed;
  batches_drawn_ = drawn;
  rng_ = rng;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<EvalWindows>> EvalWindows::Create(
    const at::Tensor& tokens, const EvalOptions& options) {
  HIMOE_RETURN_IF_ERROR(CheckWindowShape(tokens, options.batch_size,
                                   options.block_size, "eval windows"));
  if (options.max_windows < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "eval windows: max_windows must be >= 0; got ", options.max_windows));
  }
  int64_t k = (tokens.numel() - 1) / options.block_size;
  if (options.max_windows > 0) k = std::min(k, options.max_windows);
  return std::unique_ptr<EvalWindows>(new EvalWindows(tokens, options, k));
}

Batch EvalWindows::GetBatch(int64_t i) const {
  CHECK(i >= 0 && i < num_batches()) << "eval batch " << i << " of "
                                     << num_batches();
  const int64_t first = i * options_.batch_size;
  const int64_t count = std::min(options_.batch_size, num_windows_ - first);
  std::vector<int64_t> offsets(count);
  for (int64_t j = 0; j < count; ++j) {
    offsets[j] = (first + j) * options_.block_size;
  }
  return GatherWindows(tokens_, std::move(offsets), options_.block_size);
}

bool EvalWindows::Next(Batch* batch) {
  if (next_ >= num_batches()) return false;
  *batch = GetBatch(next_++);
  return true;
}

std::string DecodeBytes(const std::vector<int64_t>& ids) {
  std::string out;
  out.reserve(ids.size());
  for (const int64_t id : ids) {
    out.push_back(id >= 0 && id < kByteVocabSize ? static_cast<char>(id) : '?');
  }
  return out;
}

}  // namespace himoe::trainer
