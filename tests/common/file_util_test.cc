#include "common/file_util.h"

#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
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

}  // namespace
}  // namespace himoe
