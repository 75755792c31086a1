#ifndef HIMOE_COMMON_PARALLEL_FOR_H_
#define HIMOE_COMMON_PARALLEL_FOR_H_

#include <cstdint>
#include <functional>

namespace himoe {

// Runs fn(i) for every i in [0, n) on up to `threads` threads of the OpenMP
// pool LibTorch and BLIS share, each index on one thread, in contiguous
// blocks (static schedule). Inside fn a product is single-threaded (a nested
// OpenMP region is inactive), so this splits independent products across the
// threads where BLIS would split each small product. Runs inline when n or
// threads is 1 or when already inside a parallel region. An exception thrown
// by fn is rethrown here (the first one) after every thread is done.
void ParallelFor(int64_t n, int threads, const std::function<void(int64_t)>& fn);

// at::parallel_for's contract on the same pool: [begin, end) cut into at
// most `threads` contiguous chunks of at least `grain` indices (the last may
// be shorter), fn(chunk_begin, chunk_end) once per chunk, each on its own
// thread; inline when there is one chunk or already inside a parallel region.
// Exceptions as ParallelFor. The project's code calls this, never
// at::parallel_for: that is a header template whose OpenMP region exists
// only in a translation unit compiled with -fopenmp, and only this library's
// are, so elsewhere it ran every range on the calling thread.
void ParallelForRange(int64_t begin, int64_t end, int64_t grain, int threads,
                      const std::function<void(int64_t, int64_t)>& fn);

// Off: ParallelFor runs every index inline, so each product takes all the
// threads instead (the behaviour before ParallelFor; for comparisons). On by
// default; ConfigureCompute sets it from ComputeOptions::split_products.
void SetParallelForEnabled(bool enabled);
bool ParallelForEnabled();

// True inside a ParallelFor (or any OpenMP parallel region) with > 1 thread.
bool InParallelRegion();

}  // namespace himoe

#endif  // HIMOE_COMMON_PARALLEL_FOR_H_
