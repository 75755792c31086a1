#include "trainer/data.h"

#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/file_util.h"
#include "tests/temp_dir.h"

namespace himoe::trainer {
namespace {

using ::testing::HasSubstr;

using test_util::TempDir;
using test_util::WriteTextFile;

void WriteTokens(const std::string& path, const std::vector<uint16_t>& ids) {
  std::string bytes;
  for (const uint16_t id : ids) {
    bytes.push_back(static_cast<char>(id & 0xFF));
    bytes.push_back(static_cast<char>(id >> 8));
  }
  WriteTextFile(path, bytes);
}

std::string TensorToString(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::string(reinterpret_cast<const char*>(c.data_ptr<uint8_t>()),
                     c.numel());
}

std::vector<int64_t> ToVector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(),
                              c.data_ptr<int64_t>() + c.numel());
}

// `n` printable bytes, distinct enough that windows are identifiable.
std::string Text(int n, int salt) {
  std::string s;
  for (int i = 0; i < n; ++i) s.push_back(static_cast<char>(32 + (i * 7 + salt) % 95));
  return s;
}

std::unique_ptr<Corpus> MustCreate(const DataOptions& options) {
  auto corpus = Corpus::Create(options);
  EXPECT_TRUE(corpus.ok()) << corpus.status();
  return corpus.ok() ? std::move(corpus).value() : nullptr;
}

TEST(CorpusTest, LoadsTextFilesRecursivelySkippingDatBinaryAndDuplicates) {
  TempDir dir;
  WriteTextFile(dir.Sub("b.txt"), "bravo\n");
  WriteTextFile(dir.Sub("a/c.txt"), "charlie\n");
  WriteTextFile(dir.Sub("a/c.txt.u8"), "charlie\n");  // copy of sibling
  WriteTextFile(dir.Sub("b.dat"), "text, but an index by name\n");
  WriteTextFile(dir.Sub("bin"), std::string("ELF\0\x01\x02 more", 12));
  ASSERT_EQ(::symlink(dir.Sub("b.txt").c_str(), dir.Sub("z_link").c_str()), 0);  // same file

  DataOptions options;
  options.paths = {dir.path()};
  options.val_fraction = 0.0;
  auto corpus = MustCreate(options);
  ASSERT_NE(corpus, nullptr);
  EXPECT_EQ(corpus->format(), DataFormat::kBytes);
  EXPECT_EQ(corpus->vocab_size(), 256);
  EXPECT_EQ(corpus->train().scalar_type(), at::kByte);
  EXPECT_THAT(corpus->files(),
              ::testing::ElementsAre(dir.Sub("a/c.txt"),
                                     dir.Sub("b.txt")));
  EXPECT_EQ(corpus->skipped().size(), 4u);
  EXPECT_EQ(TensorToString(corpus->train()), "charlie\nbravo\n");
  EXPECT_EQ(corpus->val().numel(), 0);
  EXPECT_THAT(corpus->Describe(), HasSubstr("2 files (4 skipped), 14 bytes"));
}

TEST(CorpusTest, SplitFollowsThePerFileRule) {
  TempDir dir;
  const std::string first = Text(100, 0), second = Text(10, 3);
  WriteTextFile(dir.Sub("1.txt"), first);
  WriteTextFile(dir.Sub("2.txt"), second);
  DataOptions options;
  options.paths = {dir.path()};
  options.val_fraction = 0.25;
  auto corpus = MustCreate(options);
  ASSERT_NE(corpus, nullptr);
  // Val gets the last llround(n * 0.25) bytes of each file: 25 and 3 (2.5).
  const std::string train = TensorToString(corpus->train());
  const std::string val = TensorToString(corpus->val());
  ASSERT_EQ(train.size(), 75u + 7u);
  ASSERT_EQ(val.size(), 25u + 3u);
  EXPECT_EQ(train, first.substr(0, 75) + second.substr(0, 7));
  EXPECT_EQ(val, first.substr(75) + second.substr(7));
  // At the boundaries.
  EXPECT_EQ(train[74], first[74]);
  EXPECT_EQ(train[75], second[0]);
  EXPECT_EQ(val[0], first[75]);
  EXPECT_EQ(val[25], second[7]);

  auto again = MustCreate(options);
  ASSERT_NE(again, nullptr);
  EXPECT_TRUE(at::equal(corpus->train(), again->train()));
  EXPECT_TRUE(at::equal(corpus->val(), again->val()));

  // Default fraction 0.1: 10 and 1 bytes of val.
  options.val_fraction = 0.1;
  auto tenth = MustCreate(options);
  ASSERT_NE(tenth, nullptr);
  EXPECT_EQ(tenth->train().numel(), 90 + 9);
  EXPECT_EQ(tenth->val().numel(), 10 + 1);
}

TEST(CorpusTest, ExplicitFilesAreSortedByPath) {
  TempDir dir;
  WriteTextFile(dir.Sub("y"), "yy");
  WriteTextFile(dir.Sub("x"), "xx");
  DataOptions options;
  options.paths = {dir.Sub("y"), dir.Sub("x")};
  options.val_fraction = 0.0;
  auto corpus = MustCreate(options);
  ASSERT_NE(corpus, nullptr);
  EXPECT_EQ(TensorToString(corpus->train()), "xxyy");
}

TEST(CorpusTest, LoadsNanoGptBins) {
  TempDir dir;
  const std::vector<uint16_t> train = {0, 1, 255, 256, 50256, 50303, 7, 300};
  const std::vector<uint16_t> val = {42, 513, 50000};
  WriteTokens(dir.Sub("train.bin"), train);
  WriteTokens(dir.Sub("val.bin"), val);
  DataOptions options;
  options.paths = {dir.path()};  // format "auto"
  auto corpus = MustCreate(options);
  ASSERT_NE(corpus, nullptr);
  EXPECT_EQ(corpus->format(), DataFormat::kNanoGpt);
  EXPECT_EQ(corpus->vocab_size(), 50304);
  EXPECT_EQ(corpus->train().scalar_type(), at::kInt);
  EXPECT_EQ(ToVector(corpus->train()),
            std::vector<int64_t>(train.begin(), train.end()));
  EXPECT_EQ(ToVector(corpus->split(Split::kVal)),
            std::vector<int64_t>(val.begin(), val.end()));
  EXPECT_THAT(corpus->Describe(), HasSubstr("train 8 tokens, val 3 tokens"));

  options.format = "nanogpt";
  EXPECT_TRUE(Corpus::Create(options).ok());
}

TEST(CorpusTest, RejectsBadNanoGptBins) {
  TempDir dir;
  WriteTextFile(dir.Sub("train.bin"), std::string("\x01\x00\x02", 3));
  WriteTokens(dir.Sub("val.bin"), {1});
  DataOptions options;
  options.paths = {dir.path()};
  auto odd = Corpus::Create(options);
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(odd.status().message(), HasSubstr("train.bin"));
  EXPECT_THAT(odd.status().message(), HasSubstr("odd byte length 3"));

  WriteTokens(dir.Sub("train.bin"), {1, 60000});
  auto oov = Corpus::Create(options);
  EXPECT_EQ(oov.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(oov.status().message(), HasSubstr("60000"));

  WriteTokens(dir.Sub("train.bin"), {1, 2});
  ASSERT_EQ(::unlink(dir.Sub("val.bin").c_str()), 0);
  auto no_val = Corpus::Create(options);
  EXPECT_EQ(no_val.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(no_val.status().message(), HasSubstr("val.bin"));
}

TEST(CorpusTest, ClearErrors) {
  TempDir dir;
  DataOptions options;

  options.paths = {dir.Sub("missing")};
  auto missing = Corpus::Create(options);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(options.paths[0]));

  ASSERT_TRUE(CreateDirectories(dir.Sub("empty_dir")).ok());
  options.paths = {dir.Sub("empty_dir")};
  auto empty_dir = Corpus::Create(options);
  EXPECT_EQ(empty_dir.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty_dir.status().message(), HasSubstr(options.paths[0]));
  EXPECT_THAT(empty_dir.status().message(), HasSubstr("no text files"));

  WriteTextFile(dir.Sub("empty.txt"), "");
  options.paths = {dir.Sub("empty.txt")};
  auto empty_file = Corpus::Create(options);
  EXPECT_EQ(empty_file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty_file.status().message(), HasSubstr("empty corpus"));
  EXPECT_THAT(empty_file.status().message(), HasSubstr(options.paths[0]));

  options.paths = {};
  EXPECT_EQ(Corpus::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);

  WriteTextFile(dir.Sub("t.txt"), "some text");
  options.paths = {dir.Sub("t.txt")};
  options.format = "words";
  EXPECT_EQ(Corpus::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.format = "bytes";
  options.val_fraction = 1.0;
  EXPECT_EQ(Corpus::Create(options).status().code(),
            absl::StatusCode::kInvalidArgument);

  options.val_fraction = 0.1;
  options.paths = {std::string(kDefaultCorpusDir) + "/no-such-file"};
  auto no_default = Corpus::Create(options);
  EXPECT_EQ(no_default.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(no_default.status().message(),
              HasSubstr("install the fortunes package"));
}

std::unique_ptr<Corpus> SmallCorpus(const TempDir& dir) {
  WriteTextFile(dir.Sub("text.txt"), Text(1000, 1));
  DataOptions options;
  options.paths = {dir.path()};
  return MustCreate(options);
}

std::vector<std::vector<int64_t>> Draw(BatchSampler& sampler, int n) {
  std::vector<std::vector<int64_t>> out;
  for (int i = 0; i < n; ++i) {
    const Batch b = sampler.Next();
    out.push_back(ToVector(b.x));
    out.push_back(ToVector(b.y));
    out.push_back(b.offsets);
  }
  return out;
}

TEST(BatchSamplerTest, YIsXShiftedAndMatchesTheCorpus) {
  TempDir dir;
  auto corpus = SmallCorpus(dir);
  ASSERT_NE(corpus, nullptr);
  const at::Tensor tokens = corpus->train();
  BatchSamplerOptions options;
  options.batch_size = 5;
  options.block_size = 16;
  auto sampler = BatchSampler::Create(tokens, options);
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  for (int step = 0; step < 20; ++step) {
    const Batch b = (*sampler)->Next();
    ASSERT_EQ(b.x.sizes(), (std::vector<int64_t>{5, 16}));
    ASSERT_EQ(b.y.sizes(), (std::vector<int64_t>{5, 16}));
    EXPECT_EQ(b.x.scalar_type(), at::kLong);
    EXPECT_EQ(b.y.scalar_type(), at::kLong);
    EXPECT_TRUE(at::equal(b.x.narrow(1, 1, 15), b.y.narrow(1, 0, 15)));
    ASSERT_EQ(b.offsets.size(), 5u);
    for (int64_t i = 0; i < 5; ++i) {
      const int64_t off = b.offsets[i];
      ASSERT_GE(off, 0);
      ASSERT_LT(off, tokens.numel() - 16);
      EXPECT_TRUE(at::equal(b.x[i], tokens.narrow(0, off, 16).to(at::kLong)));
      EXPECT_TRUE(at::equal(b.y[i], tokens.narrow(0, off + 1, 16).to(at::kLong)));
    }
  }
  EXPECT_EQ((*sampler)->batches_drawn(), 20);
}

TEST(BatchSamplerTest, SameSeedSameBatchesAndGlobalRngUntouched) {
  TempDir dir;
  auto corpus = SmallCorpus(dir);
  ASSERT_NE(corpus, nullptr);
  BatchSamplerOptions options;
  options.batch_size = 4;
  options.block_size = 8;
  options.seed = 7;
  auto a = BatchSampler::Create(corpus->train(), options);
  auto b = BatchSampler::Create(corpus->train(), options);
  options.seed = 8;
  auto c = BatchSampler::Create(corpus->train(), options);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  at::manual_seed(123);
  const at::Tensor before = at::rand({4});
  at::manual_seed(123);
  const auto from_a = Draw(**a, 10);
  const at::Tensor after = at::rand({4});
  EXPECT_TRUE(at::equal(before, after));  // the global torch RNG was not used
  EXPECT_EQ(from_a, Draw(**b, 10));
  EXPECT_NE(from_a, Draw(**c, 10));
}

TEST(BatchSamplerTest, RestoreStateResumesTheSameSequence) {
  TempDir dir;
  auto corpus = SmallCorpus(dir);
  ASSERT_NE(corpus, nullptr);
  BatchSamplerOptions options;
  options.batch_size = 3;
  options.block_size = 12;
  options.seed = 99;
  auto sampler = BatchSampler::Create(corpus->train(), options);
  ASSERT_TRUE(sampler.ok());
  Draw(**sampler, 3);
  const std::string state = (*sampler)->SerializeState();
  const auto expected = Draw(**sampler, 5);

  options.seed = 1;  // the state overrides the seed
  auto resumed = BatchSampler::Create(corpus->train(), options);
  ASSERT_TRUE(resumed.ok());
  ASSERT_TRUE((*resumed)->RestoreState(state).ok());
  EXPECT_EQ((*resumed)->batches_drawn(), 3);
  EXPECT_EQ((*resumed)->options().seed, 99u);
  EXPECT_EQ(Draw(**resumed, 5), expected);
  EXPECT_EQ((*resumed)->batches_drawn(), 8);
  EXPECT_EQ((*resumed)->SerializeState(), (*sampler)->SerializeState());

  // Malformed or mismatched states are rejected and change nothing.
  const std::string now = (*resumed)->SerializeState();
  EXPECT_EQ((*resumed)->RestoreState("garbage").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*resumed)->RestoreState(state.substr(0, state.size() / 2)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*resumed)->RestoreState(state + " 5").code(),
            absl::StatusCode::kInvalidArgument);
  options.block_size = 13;
  auto other = BatchSampler::Create(corpus->train(), options);
  ASSERT_TRUE(other.ok());
  const absl::Status mismatch = (*other)->RestoreState(state);
  EXPECT_EQ(mismatch.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mismatch.message(), HasSubstr("block_size 12"));
  EXPECT_EQ((*resumed)->SerializeState(), now);
}

TEST(BatchSamplerTest, RejectsSplitTooShortForBlock) {
  TempDir dir;
  auto corpus = SmallCorpus(dir);  // val: 100 bytes
  ASSERT_NE(corpus, nullptr);
  ASSERT_EQ(corpus->val().numel(), 100);
  BatchSamplerOptions options;
  options.block_size = 100;
  auto sampler = BatchSampler::Create(corpus->val(), options);
  EXPECT_EQ(sampler.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(sampler.status().message(), HasSubstr("too short"));
  options.block_size = 99;  // exactly one window
  auto one = BatchSampler::Create(corpus->val(), options);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ((*one)->Next().offsets, std::vector<int64_t>(12, 0));
  EvalOptions eval;
  eval.block_size = 100;
  EXPECT_EQ(EvalWindows::Create(corpus->val(), eval).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(EvalWindowsTest, FirstKFixedWindows) {
  TempDir dir;
  auto corpus = SmallCorpus(dir);
  ASSERT_NE(corpus, nullptr);
  const at::Tensor val = corpus->val();  // 100 tokens
  EvalOptions options;
  options.batch_size = 4;
  options.block_size = 10;
  options.max_windows = 10;
  auto eval = EvalWindows::Create(val, options);
  ASSERT_TRUE(eval.ok()) << eval.status();
  // (100 - 1) / 10 = 9 full windows, fewer than the 10 asked for.
  EXPECT_EQ((*eval)->num_windows(), 9);
  EXPECT_EQ((*eval)->num_batches(), 3);

  std::vector<int64_t> offsets;
  std::vector<std::vector<int64_t>> first_pass;
  Batch b;
  while ((*eval)->Next(&b)) {
    for (int64_t i = 0; i < b.x.size(0); ++i) {
      const int64_t off = b.offsets[i];
      EXPECT_TRUE(at::equal(b.x[i], val.narrow(0, off, 10).to(at::kLong)));
      EXPECT_TRUE(at::equal(b.y[i], val.narrow(0, off + 1, 10).to(at::kLong)));
    }
    offsets.insert(offsets.end(), b.offsets.begin(), b.offsets.end());
    first_pass.push_back(ToVector(b.x));
  }
  EXPECT_EQ(offsets, (std::vector<int64_t>{0, 10, 20, 30, 40, 50, 60, 70, 80}));
  EXPECT_EQ(b.x.size(0), 1);  // last batch holds the 9th window only

  (*eval)->Reset();
  for (size_t i = 0; (*eval)->Next(&b); ++i) {
    ASSERT_LT(i, first_pass.size());
    EXPECT_EQ(ToVector(b.x), first_pass[i]);
  }
  EXPECT_EQ(ToVector((*eval)->GetBatch(1).x), first_pass[1]);

  options.max_windows = 2;
  auto two = EvalWindows::Create(val, options);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ((*two)->num_windows(), 2);
  EXPECT_EQ((*two)->GetBatch(0).offsets, (std::vector<int64_t>{0, 10}));
}

TEST(DecodeBytesTest, RoundTripsText) {
  const std::string text = "Hello, fortune!\n\xc3\xa9";
  std::vector<int64_t> ids;
  for (const unsigned char c : text) ids.push_back(c);
  EXPECT_EQ(DecodeBytes(ids), text);
  EXPECT_EQ(DecodeBytes({72, 300, -1, 105}), "H??i");
}

TEST(DefaultCorpusTest, LoadsTheFortunesCorpus) {
  ASSERT_EQ(DefaultCorpusPaths(), std::vector<std::string>{kDefaultCorpusDir});
  ASSERT_TRUE(IsDirectory(kDefaultCorpusDir))
      << kDefaultCorpusDir
      << " is missing: install the fortunes package (apt-get install fortunes; "
         "scripts/setup.sh does)";
  DataOptions options;
  options.paths = DefaultCorpusPaths();
  auto corpus = MustCreate(options);
  ASSERT_NE(corpus, nullptr);
  std::cout << corpus->Describe() << "\n";
  EXPECT_EQ(corpus->format(), DataFormat::kBytes);
  const int64_t total = corpus->train().numel() + corpus->val().numel();
  EXPECT_GT(total, 1000 * 1000);
  EXPECT_FALSE(corpus->train().eq(0).any().item<bool>());
  EXPECT_FALSE(corpus->val().eq(0).any().item<bool>());
  for (const std::string& f : corpus->files()) {
    EXPECT_FALSE(f.size() >= 4 && f.substr(f.size() - 4) == ".dat") << f;
    EXPECT_FALSE(f.size() >= 3 && f.substr(f.size() - 3) == ".u8") << f;
  }
  // Val is about 10% of the text.
  EXPECT_NEAR(static_cast<double>(corpus->val().numel()) / total, 0.1, 0.001);
  const std::string head = DecodeBytes(ToVector(corpus->train().narrow(0, 0, 64)));
  EXPECT_EQ(head.find('\0'), std::string::npos);
}

}  // namespace
}  // namespace himoe::trainer
