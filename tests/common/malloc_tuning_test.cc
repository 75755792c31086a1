#include "common/malloc_tuning.h"

#include <malloc.h>
#include <stdlib.h>

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"

namespace himoe {
namespace {

// Freed memory stays in the heap: a block far over glibc's default mmap
// threshold (128 KiB) comes from the heap, not from a mapping of its own.
TEST(MallocTuningTest, TheHeapIsKeptForReuse) {
  ASSERT_EQ(std::getenv("MALLOC_MMAP_THRESHOLD_"), nullptr);
  EXPECT_EQ(KeepHeap(), "heap kept (mmap from 32 MiB, trim above 256 MiB)");
  const size_t mapped_before = mallinfo2().hblks;
  void* block = std::malloc(8 << 20);
  ASSERT_NE(block, nullptr);
  static_cast<volatile char*>(block)[0] = 1;
  EXPECT_EQ(mallinfo2().hblks, mapped_before);
  std::free(block);
}

// A MALLOC_* setting in the environment wins: the allocator is left as
// glibc set it up from the variable, and the log says why.
TEST(MallocTuningTest, TheEnvironmentWins) {
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"}) {
    setenv(name, "131072", 1);
    EXPECT_EQ(KeepHeap(), std::string(name) + " from the environment");
    unsetenv(name);
  }
}

}  // namespace
}  // namespace himoe
