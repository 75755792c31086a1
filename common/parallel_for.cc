#include "common/parallel_for.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>

namespace himoe {
namespace {

std::atomic<bool> enabled{true};

}  // namespace

void SetParallelForEnabled(bool on) { enabled.store(on); }
bool ParallelForEnabled() { return enabled.load(); }

void ParallelFor(int64_t n, int threads, const std::function<void(int64_t)>& fn) {
  const int64_t team = std::min<int64_t>(n, threads);
  if (team <= 1 || omp_in_parallel() || !enabled.load(std::memory_order_relaxed)) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::exception_ptr error;
  std::once_flag first;
#pragma omp parallel for schedule(static) num_threads(team)
  for (int64_t i = 0; i < n; ++i) {
    try {
      fn(i);
    } catch (...) {
      std::call_once(first, [&] { error = std::current_exception(); });
    }
  }
  if (error) std::rethrow_exception(error);
}

void ParallelForRange(int64_t begin, int64_t end, int64_t grain, int threads,
                      const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t chunks_of_grain = grain > 1 ? (n + grain - 1) / grain : n;
  const int64_t team = std::min<int64_t>(chunks_of_grain, std::max(threads, 1));
  if (team <= 1 || omp_in_parallel()) {
    fn(begin, end);
    return;
  }
  std::exception_ptr error;
  std::once_flag first;
#pragma omp parallel num_threads(team)
  {
    // The team may be smaller than asked for: cut by the threads there are.
    const int64_t size = omp_get_num_threads();
    const int64_t chunk = (n + size - 1) / size;
    const int64_t from = begin + omp_get_thread_num() * chunk;
    if (from < end) {
      try {
        fn(from, std::min(end, from + chunk));
      } catch (...) {
        std::call_once(first, [&] { error = std::current_exception(); });
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

bool InParallelRegion() { return omp_in_parallel() != 0; }

}  // namespace himoe
