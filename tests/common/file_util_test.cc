#include "common/file_util.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/temp_dir.h"

namespace himoe {
namespace {

// The oracle is what the test made (and stat/lstat(2)), not std::filesystem:
// this binary must not call it (tests/temp_dir.h says why).
class FileUtilTest : public ::testing::Test {
 protected:
  std::string At(absl::string_view name) const { return temp_.Sub(name); }
  test_util::TempDir temp_{"himoe_file_util"};
  const std::string& dir_ = temp_.path();
};

bool IsSymlink(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

TEST_F(FileUtilTest, WritesReplacesAndLeavesNoTemporary) {
  const std::string path = At("ports");
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
  EXPECT_EQ(*ListDirectory(dir_), std::vector<std::string>{"ports"});  // the temporary renamed
}

TEST_F(FileUtilTest, ErrorsNameThePath) {
  auto missing = ReadFileToString(At("absent"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("absent"), std::string::npos);
  const absl::Status s = WriteFileAtomically(At("no/such/dir"), "x");
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

void Touch(const std::string& p, const std::string& text = "x") { std::ofstream(p) << text; }

std::vector<std::string> Sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

TEST_F(FileUtilTest, KindsSizesDirectoriesListingAndRenames) {
  const std::string file = At("f.txt"), sub = At("a/b/c");
  Touch(file, "12345");
  ASSERT_EQ(::mkfifo(At("fifo").c_str(), 0600), 0);
  ASSERT_EQ(::symlink(file.c_str(), At("link_to_file").c_str()), 0);
  EXPECT_EQ(KindOf(file), PathKind::kFile);
  EXPECT_EQ(KindOf(At("link_to_file")), PathKind::kFile);  // followed
  EXPECT_EQ(KindOf(dir_), PathKind::kDirectory);
  EXPECT_EQ(KindOf(At("fifo")), PathKind::kOther);
  EXPECT_EQ(KindOf(At("absent")), PathKind::kMissing);
  EXPECT_EQ(*FileSize(file), 5);
  EXPECT_THAT(FileSize(At("absent")).status().message(), ::testing::HasSubstr("absent"));

  ASSERT_TRUE(CreateDirectories(sub).ok());
  EXPECT_TRUE(IsDirectory(sub));
  EXPECT_TRUE(IsDirectory(At("a/b")));
  EXPECT_TRUE(CreateDirectories(sub).ok());  // exists already
  // realpath(3) of a link reached through "." and "..": the file it names.
  const std::string canonical_dir = *CanonicalPath(dir_);
  EXPECT_EQ(canonical_dir.front(), '/');
  EXPECT_EQ(*CanonicalPath(At("./a/b/../../link_to_file")), JoinPath(canonical_dir, "f.txt"));
  EXPECT_FALSE(CanonicalPath(At("absent")).ok());
  EXPECT_FALSE(CreateDirectories(JoinPath(file, "below_a_file")).ok());
  EXPECT_EQ(Sorted(*ListDirectory(dir_)),
            (std::vector<std::string>{"a", "f.txt", "fifo", "link_to_file"}));
  EXPECT_FALSE(ListDirectory(At("absent")).ok());

  const absl::Status renamed = RenamePath(At("absent"), At("x"));
  EXPECT_EQ(renamed.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(renamed.message(), ::testing::HasSubstr("absent -> "));
  ASSERT_TRUE(RenamePath(file, At("g.txt")).ok());
  EXPECT_TRUE(IsRegularFile(At("g.txt")));
  EXPECT_EQ(KindOf(file), PathKind::kMissing);
}

// Recursion as std::filesystem::recursive_directory_iterator's: regular
// files and links to them; a link to a directory is not entered. RemoveAll
// removes such a link, not what it points to.
TEST_F(FileUtilTest, RegularFilesUnderAndRemoveAllDoNotFollowDirectoryLinks) {
  const std::string outside = At("outside"), tree = At("tree");
  ASSERT_TRUE(CreateDirectories(outside).ok());
  ASSERT_TRUE(CreateDirectories(At("tree/x/y")).ok());
  Touch(At("outside/keep.txt"));
  Touch(At("tree/top.txt"));
  Touch(At("tree/x/y/deep.txt"));
  ASSERT_EQ(::mkfifo(At("tree/x/fifo").c_str(), 0600), 0);
  ASSERT_EQ(::symlink(At("outside/keep.txt").c_str(), At("tree/x/file_link").c_str()), 0);
  ASSERT_EQ(::symlink(outside.c_str(), At("tree/dir_link").c_str()), 0);

  EXPECT_EQ(Sorted(*RegularFilesUnder(tree)),
            Sorted({At("tree/top.txt"), At("tree/x/y/deep.txt"), At("tree/x/file_link")}));
  EXPECT_FALSE(RegularFilesUnder(At("absent")).ok());

  ASSERT_TRUE(RemoveAll(tree).ok());
  EXPECT_EQ(KindOf(tree), PathKind::kMissing);
  EXPECT_FALSE(IsSymlink(At("tree/dir_link")));
  EXPECT_TRUE(IsRegularFile(At("outside/keep.txt")));
  EXPECT_TRUE(RemoveAll(tree).ok());  // missing is fine
}

}  // namespace
}  // namespace himoe
