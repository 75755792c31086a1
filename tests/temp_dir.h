// A fresh directory for one test, removed with what it holds at the end.
// Test binaries use common/file_util's POSIX calls, not std::filesystem, as
// the binaries do: pip's LibTorch (2.5 and later) exports its own
// std::filesystem, which takes such calls and crashes (pytorch#133437;
// Cli.NoStdFilesystem checks the test binaries too).
#ifndef HIMOE_TESTS_TEMP_DIR_H_
#define HIMOE_TESTS_TEMP_DIR_H_

#include <stdlib.h>

#include <fstream>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/file_util.h"
#include "gtest/gtest.h"

namespace himoe::test_util {

class TempDir {
 public:
  // mkdtemp under gtest's temporary directory ($TEST_TMPDIR, $TMPDIR or /tmp).
  explicit TempDir(absl::string_view prefix = "himoe_test") {
    std::string pattern = absl::StrCat(::testing::TempDir(), prefix, "_XXXXXX");
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
    EXPECT_FALSE(path_.empty()) << "mkdtemp " << pattern;
  }
  ~TempDir() {
    if (!path_.empty()) (void)RemoveAll(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // path()/relative.
  std::string Sub(absl::string_view relative) const { return JoinPath(path_, relative); }

 private:
  std::string path_;
};

// Writes `text` to `path`, creating the directories above it.
inline void WriteTextFile(const std::string& path, absl::string_view text) {
  EXPECT_TRUE(CreateDirectories(Dirname(path)).ok()) << path;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  EXPECT_TRUE(out.good()) << path;
}

// The whole of `path`, or "" when it cannot be read.
inline std::string ReadTextFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  return text.ok() ? *std::move(text) : std::string();
}

inline bool PathExists(const std::string& path) { return KindOf(path) != PathKind::kMissing; }

}  // namespace himoe::test_util

#endif  // HIMOE_TESTS_TEMP_DIR_H_
