#include "common/blas_kernel_probe.h"

#include <stdlib.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <glog/logging.h>

#include "absl/status/status.h"
#include "common/blas_library.h"
#include "common/blis_kernel_cache.h"
#include "common/gemm_rate.h"
#include "common/probe_process.h"

namespace himoe {
namespace {

// BLIS's table of kernel sets, asked in a child (the query fixes the choice
// of the library it loads).
std::string BlisKernelTableInChild() {
  return RunInChild({{kBlisArchEnv, ""}, {kBlisThreadsEnv, "1"}},
                    [] { return BlisKernelSets(); });
}

}  // namespace

std::string FastestCorrectKernels(const std::vector<KernelProbe>& probes) {
  std::string fastest;
  double best = 0;
  for (const KernelProbe& p : probes) {
    if (p.error.empty() && p.gflops > best) {
      best = p.gflops;
      fastest = p.name;
    }
  }
  return fastest;
}

BlisKernelChoice SelectBlisKernels(bool probe, const std::string& cache_file) {
  BlisKernelChoice choice;
  const std::string answer = BlisKernelTableInChild();
  const std::optional<BlisKernelTable> table = ParseBlisKernelTable(answer);
  choice.source = "library";
  if (!table) return choice;
  choice.kernels = table->choice;
  if (probe && choice.kernels == "generic") {
    const std::string key = KernelCacheKey(answer);
    if (std::string cached = ReadCachedKernels(cache_file, key, table->ids); !cached.empty()) {
      choice.kernels = std::move(cached);
      choice.source = "cached";
    } else {
      for (const std::string& name : CandidateBlisKernels()) {
        const auto id = table->ids.find(name);
        if (id == table->ids.end()) continue;
        KernelProbe p;
        p.name = name;
        p.gflops = ParseProbeAnswer(
            RunInChild({{kBlisArchEnv, id->second}, {kBlisThreadsEnv, "1"}},
                       [] { return RunGemmProbe(1, 1024, 256, 512, 0.04); }),
            &p.error);
        choice.probes.push_back(p);
      }
      if (std::string fastest = FastestCorrectKernels(choice.probes); !fastest.empty()) {
        choice.kernels = std::move(fastest);
        choice.source = "probed";
      }
      if (choice.source == "probed" && !cache_file.empty()) {
        // A cache that cannot be written only costs the next start a probe.
        if (absl::Status s = WriteCachedKernels(cache_file, key, choice.kernels); !s.ok()) {
          LOG(INFO) << "BLIS kernel choice not cached: " << s;
        }
      }
    }
  }
  if (const auto id = table->ids.find(choice.kernels); id != table->ids.end()) {
    setenv(kBlisArchEnv, id->second.c_str(), 1);
  }
  return choice;
}

std::string BlisKernelName(const std::string& value) {
  const std::optional<BlisKernelTable> table = ParseBlisKernelTable(BlisKernelTableInChild());
  if (!table) return value;
  for (const auto& [name, id] : table->ids) {
    if (id == value) return name;
  }
  return value;
}

int BlisThreadsFor(int threads, double one_thread_gflops, double threads_gflops) {
  return one_thread_gflops > threads_gflops ? 1 : threads;
}

BlisThreadChoice SelectBlisThreads(int threads) {
  BlisThreadChoice choice;
  choice.blas_threads = threads;
  if (threads <= 1) return choice;
  const auto rate = [&](int blas_threads) {
    std::string error;
    const char* kernels = std::getenv(kBlisArchEnv);
    return ParseProbeAnswer(
        RunInChild({{kBlisArchEnv, kernels ? kernels : ""},
                    {kBlisThreadsEnv, std::to_string(blas_threads)}},
                   [] { return RunGemmProbe(1, 2048, 128, 512, 0.05); }),
        &error);
  };
  choice.gflops = {rate(1), rate(threads)};
  choice.blas_threads = BlisThreadsFor(threads, choice.gflops[0], choice.gflops[1]);
  if (choice.blas_threads == 1) setenv(kBlisThreadsEnv, "1", 1);
  return choice;
}

}  // namespace himoe
