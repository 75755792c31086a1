#include "common/malloc_tuning.h"

#include <malloc.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace himoe {

std::string KeepHeap() {
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"}) {
    if (std::getenv(name) != nullptr) return absl::StrCat(name, " from the environment");
  }
  constexpr int kMmapThreshold = 32 << 20;  // glibc's largest
  constexpr int kTrimThreshold = 256 << 20;
  constexpr int kTopPad = 16 << 20;
  if (mallopt(M_MMAP_THRESHOLD, kMmapThreshold) != 1 ||
      mallopt(M_TRIM_THRESHOLD, kTrimThreshold) != 1 || mallopt(M_TOP_PAD, kTopPad) != 1) {
    return "glibc defaults (mallopt refused)";
  }
  return "heap kept (mmap from 32 MiB, trim above 256 MiB)";
}

}  // namespace himoe
