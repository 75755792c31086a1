#ifndef HIMOE_COMMON_MALLOC_TUNING_H_
#define HIMOE_COMMON_MALLOC_TUNING_H_

#include <string>

namespace himoe {

// Tensors of a step come and go every step. With glibc's defaults each one
// over its dynamic mmap threshold is mapped and unmapped, and the heap top is
// trimmed and regrown, so every step page-faults its memory in again (see
// docs/benchmarks.md, Measurements behind choices in the code). Keeps freed
// memory for reuse instead, as jemalloc and tcmalloc do: mmap from 32 MiB,
// trim above 256 MiB. MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or
// MALLOC_TOP_PAD_ in the environment win: then glibc's settings stay.
// Returns how the allocator was set up, for the log.
std::string KeepHeap();

}  // namespace himoe

#endif  // HIMOE_COMMON_MALLOC_TUNING_H_
