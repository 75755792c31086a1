#include "common/file_util.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace himoe {
namespace {

namespace fs = std::filesystem;

class FileUtilTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("himoe_file_util_", ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(FileUtilTest, WritesReplacesAndLeavesNoTemporary) {
  const std::string path = (dir_ / "ports").string();
  for (const bool durable : {false, true}) {
    ASSERT_TRUE(WriteFileAtomically(path, "50051 9465\n", durable).ok());
    auto read = ReadFileToString(path);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, "50051 9465\n");
    ASSERT_TRUE(WriteFileAtomically(path, std::string(3 << 16, 'x'), durable).ok());
    read = ReadFileToString(path);
    ASSERT_TRUE(read.ok());
    EXPECT_EQ(*read, std::string(3 << 16, 'x'));  // longer than one read() buffer
  }
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir_)) entries += e.exists();
  EXPECT_EQ(entries, 1);  // the temporary was renamed away
}

TEST_F(FileUtilTest, ErrorsNameThePath) {
  auto missing = ReadFileToString((dir_ / "absent").string());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("absent"), std::string::npos);
  const absl::Status s = WriteFileAtomically((dir_ / "no" / "such" / "dir").string(), "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("no/such/dir"), std::string::npos) << s;
}

TEST(PathTest, JoinBasenameDirname) {
  EXPECT_EQ(JoinPath("a/b", "c"), "a/b/c");
  EXPECT_EQ(JoinPath("a/b/", "c"), "a/b/c");
  EXPECT_EQ(JoinPath("", "c"), "c");
  EXPECT_EQ(JoinPath("/", "c"), "/c");
  EXPECT_EQ(Basename("a/b/c.txt"), "c.txt");
  EXPECT_EQ(Basename("c.txt"), "c.txt");
  EXPECT_EQ(Basename("a/"), "");
  EXPECT_EQ(Dirname("a/b/c"), "a/b");
  EXPECT_EQ(Dirname("/a"), "/");
  EXPECT_EQ(Dirname("a"), ".");
}

void Touch(const fs::path& p, const std::string& text = "x") { std::ofstream(p) << text; }

std::vector<std::string> Sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

// The POSIX replacements of std::filesystem, against std::filesystem itself
// (here, with Debian's LibTorch, it is libstdc++'s).
TEST_F(FileUtilTest, PathCallsAgreeWithStdFilesystem) {
  const fs::path file = dir_ / "f.txt", sub = dir_ / "a" / "b" / "c";
  Touch(file, "12345");
  ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0600), 0);
  fs::create_symlink(file, dir_ / "link_to_file");
  EXPECT_EQ(KindOf(file.string()), PathKind::kFile);
  EXPECT_EQ(KindOf((dir_ / "link_to_file").string()), PathKind::kFile);  // followed
  EXPECT_EQ(KindOf(dir_.string()), PathKind::kDirectory);
  EXPECT_EQ(KindOf((dir_ / "fifo").string()), PathKind::kOther);
  EXPECT_EQ(KindOf((dir_ / "absent").string()), PathKind::kMissing);
  EXPECT_EQ(*FileSize(file.string()), 5);
  EXPECT_THAT(FileSize((dir_ / "absent").string()).status().message(),
              ::testing::HasSubstr("absent"));
  EXPECT_EQ(*CanonicalPath((dir_ / "link_to_file").string()), fs::canonical(file).string());

  ASSERT_TRUE(CreateDirectories(sub.string()).ok());
  EXPECT_TRUE(fs::is_directory(sub));
  EXPECT_TRUE(CreateDirectories(sub.string()).ok());  // exists already
  EXPECT_FALSE(CreateDirectories((file / "below_a_file").string()).ok());
  EXPECT_EQ(Sorted(*ListDirectory(dir_.string())),
            (std::vector<std::string>{"a", "f.txt", "fifo", "link_to_file"}));
  EXPECT_FALSE(ListDirectory((dir_ / "absent").string()).ok());

  const absl::Status renamed = RenamePath((dir_ / "absent").string(), (dir_ / "x").string());
  EXPECT_EQ(renamed.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(renamed.message(), ::testing::HasSubstr("absent -> "));
  ASSERT_TRUE(RenamePath(file.string(), (dir_ / "g.txt").string()).ok());
  EXPECT_TRUE(fs::exists(dir_ / "g.txt"));
  EXPECT_FALSE(fs::exists(file));
}

// Recursion as recursive_directory_iterator's: regular files and links to
// them; a link to a directory is not entered. RemoveAll removes such a link,
// not what it points to.
TEST_F(FileUtilTest, RegularFilesUnderAndRemoveAllDoNotFollowDirectoryLinks) {
  const fs::path outside = dir_ / "outside", tree = dir_ / "tree";
  fs::create_directories(outside);
  fs::create_directories(tree / "x" / "y");
  Touch(outside / "keep.txt");
  Touch(tree / "top.txt");
  Touch(tree / "x" / "y" / "deep.txt");
  ASSERT_EQ(::mkfifo((tree / "x" / "fifo").c_str(), 0600), 0);
  fs::create_symlink(outside / "keep.txt", tree / "x" / "file_link");
  fs::create_directory_symlink(outside, tree / "dir_link");

  std::vector<std::string> want;
  for (const auto& e : fs::recursive_directory_iterator(tree)) {
    if (e.is_regular_file()) want.push_back(e.path().string());
  }
  EXPECT_EQ(want.size(), 3u);  // top, deep, file_link
  EXPECT_EQ(Sorted(*RegularFilesUnder(tree.string())), Sorted(want));
  EXPECT_FALSE(RegularFilesUnder((dir_ / "absent").string()).ok());

  ASSERT_TRUE(RemoveAll(tree.string()).ok());
  EXPECT_FALSE(fs::exists(tree));
  EXPECT_TRUE(fs::exists(outside / "keep.txt"));
  EXPECT_TRUE(RemoveAll(tree.string()).ok());  // missing is fine
}

}  // namespace
}  // namespace himoe
