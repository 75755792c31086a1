#include "common/blis_kernel_cache.h"

#include <stdlib.h>

#include <map>
#include <optional>
#include <sstream>
#include <string>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/file_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/temp_dir.h"

namespace himoe {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Sets (or with nullopt unsets) a variable for the scope of one test.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old;
    if (value) {
      setenv(name, value->c_str(), 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(BlisKernelCacheTest, TheDefaultFileFollowsTheEnvironment) {
  ScopedEnv home("HOME", "/home/u");
  {
    ScopedEnv xdg("XDG_CACHE_HOME", std::nullopt);
    ScopedEnv dir("HIMOE_CACHE_DIR", std::nullopt);
    EXPECT_EQ(DefaultKernelCacheFile(), "/home/u/.cache/himoe/blis-kernels");
  }
  {
    ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
    ScopedEnv dir("HIMOE_CACHE_DIR", std::nullopt);
    EXPECT_EQ(DefaultKernelCacheFile(), "/xdg/himoe/blis-kernels");
  }
  {
    ScopedEnv xdg("XDG_CACHE_HOME", "/xdg");
    ScopedEnv dir("HIMOE_CACHE_DIR", "/cache");
    EXPECT_EQ(DefaultKernelCacheFile(), "/cache/blis-kernels");
  }
  {
    ScopedEnv dir("HIMOE_CACHE_DIR", "");  // empty: no cache
    EXPECT_EQ(DefaultKernelCacheFile(), "");
  }
  {
    ScopedEnv xdg("XDG_CACHE_HOME", "");
    ScopedEnv dir("HIMOE_CACHE_DIR", std::nullopt);
    ScopedEnv no_home("HOME", std::nullopt);
    EXPECT_EQ(DefaultKernelCacheFile(), "");
  }
}

constexpr char kCpuinfo[] =
    "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
    "model name\t: AMD EPYC\nstepping\t: 1\ncpu MHz\t\t: 2600.000\n"
    "flags\t\t: fpu avx avx2\n\nprocessor\t: 1\nvendor_id\t: Other\n";

// The key holds the first processor's identity, its flags' hash (not its
// clock) and BLIS's table.
TEST(BlisKernelCacheTest, TheKeyNamesTheCpuAndTheBlis) {
  std::istringstream cpuinfo(kCpuinfo);
  const std::string key = KernelCacheKeyFor(cpuinfo, "OK generic skx=3 generic=25");
  EXPECT_THAT(key, HasSubstr("cpu vendor_id=AuthenticAMD;cpu family=26;model=2;"
                             "model name=AMD EPYC;stepping=1; flags "));
  EXPECT_THAT(key, HasSubstr(" | blis OK generic skx=3 generic=25"));
  EXPECT_THAT(key, Not(HasSubstr("Other")));
  EXPECT_THAT(key, Not(HasSubstr("2600")));

  std::string other_flags(kCpuinfo);
  other_flags.replace(other_flags.find("avx2"), 4, "avx512f");
  std::istringstream other(other_flags);
  EXPECT_NE(KernelCacheKeyFor(other, "OK generic skx=3 generic=25"), key);
  std::istringstream same(kCpuinfo);
  EXPECT_EQ(KernelCacheKeyFor(same, "OK generic skx=3 generic=25"), key);

  const std::string here = KernelCacheKey("OK generic");
  EXPECT_THAT(here, HasSubstr("model name="));
  EXPECT_THAT(here, HasSubstr("| blis OK generic"));
}

// A choice is read back under its key, in a folder created for it; another
// key, or kernels BLIS does not list, read as none.
TEST(BlisKernelCacheTest, AChoiceIsReadBackUnderItsKeyOnly) {
  const test_util::TempDir temp("himoe_kernel_cache");
  const std::string path = temp.Sub("sub/blis-kernels");
  const std::map<std::string, std::string> ids = {{"skx", "3"}, {"generic", "25"}};
  EXPECT_EQ(ReadCachedKernels(path, "key", ids), "");  // no file yet
  ASSERT_TRUE(WriteCachedKernels(path, "key", "skx").ok());
  const auto text = ReadFileToString(path);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "key\nskx\n");
  EXPECT_EQ(ReadCachedKernels(path, "key", ids), "skx");
  EXPECT_EQ(ReadCachedKernels(path, "another key", ids), "");
  EXPECT_EQ(ReadCachedKernels(path, "key", {{"generic", "25"}}), "");
  EXPECT_EQ(ReadCachedKernels("", "key", ids), "");
  test_util::WriteTextFile(path, "key\n");
  EXPECT_EQ(ReadCachedKernels(path, "key", ids), "");
}

TEST(BlisKernelCacheTest, AnUnwritableCacheIsAnError) {
  const test_util::TempDir temp("himoe_kernel_cache");
  test_util::WriteTextFile(temp.Sub("file"), "not a folder");
  EXPECT_FALSE(WriteCachedKernels(temp.Sub("file/blis-kernels"), "key", "skx").ok());
}

}  // namespace
}  // namespace himoe
