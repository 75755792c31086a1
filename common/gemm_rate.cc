#include "common/gemm_rate.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/blas_library.h"
#include "common/matmul.h"
#include "common/probe_process.h"
#include "common/status_macros.h"
#include "common/torch_runtime.h"

namespace himoe {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

// In a process MeasureGemmRateInFreshProcess started: answers its request
// from a static initializer and exits before main.
bool RunGemmRateProbeIfAsked() {
  const char* request = std::getenv(kGemmRateProbeEnv);
  if (request == nullptr) return false;
  int threads = 0, fd = -1, bf16 = 0;
  const std::vector<std::string> parts = absl::StrSplit(request, ' ');
  if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &threads) ||
      !absl::SimpleAtoi(parts[1], &fd) || !absl::SimpleAtoi(parts[2], &bf16)) {
    _exit(2);
  }
  AnswerAndExit(fd, RunGemmProbe(threads, 1024, 1024, 1024, kGemmRateSeconds, bf16 != 0));
}

[[maybe_unused]] const bool kGemmRateProbeChild = RunGemmRateProbeIfAsked();

}  // namespace

at::Tensor ProbeMatrix(int64_t rows, int64_t cols) {
  static at::Generator generator = at::detail::createCPUGenerator(20261123);
  return at::randn({rows, cols}, generator);
}

double TimeGemm(const at::Tensor& a, const at::Tensor& b, double seconds, bool bf16) {
  const double flops = 2.0 * a.size(0) * a.size(1) * b.size(1);
  at::Tensor c = at::mm(a, b);  // warm-up: packing buffers, thread start
  const auto product = [&] {
    if (bf16) {
      MatmulBf16Out(c, a, b, 0.0f);
    } else {
      at::mm_out(c, a, b);
    }
  };
  product();
  double best = 0;
  const auto start = std::chrono::steady_clock::now();
  int reps = 0;
  while (reps < 3 || Seconds(start) < seconds) {
    const auto t0 = std::chrono::steady_clock::now();
    product();
    best = std::max(best, flops / Seconds(t0) / 1e9);
    ++reps;
  }
  return best;
}

double MaxGemmError(const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& c, int64_t rows, int64_t cols) {
  const auto ac = a.accessor<float, 2>();
  const auto bc = b.accessor<float, 2>();
  const auto cc = c.accessor<float, 2>();
  double worst = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      double sum = 0;
      for (int64_t k = 0; k < a.size(1); ++k) {
        sum += static_cast<double>(ac[i][k]) * bc[k][j];
      }
      worst = std::max(worst, std::abs(sum - cc[i][j]));
    }
  }
  return worst;
}

std::string RunGemmProbe(int threads, int64_t rows, int64_t inner, int64_t cols,
                         double seconds, bool bf16) {
  try {
    at::set_num_threads(threads);
    const at::Tensor a = ProbeMatrix(rows, inner);
    const at::Tensor b = ProbeMatrix(inner, cols);
    const double gflops = TimeGemm(a, b, seconds, bf16);
    // Each entry sums `inner` products of N(0,1) values (|c| ~ 16 for 256),
    // float error ~1e-5 relative, bf16 operands' ~4e-3; a wrong kernel is
    // off by O(|c|).
    at::Tensor c = at::mm(a, b);
    if (bf16) MatmulBf16Out(c, a, b, 0.0f);
    const double error = MaxGemmError(a, b, c, 16, cols);
    if (!(error < (bf16 ? 1.0 : 1e-2))) {
      return absl::StrFormat("ERR wrong result: max error %g", error);
    }
    return absl::StrFormat("OK %.3f", gflops);
  } catch (const std::exception& e) {
    return absl::StrCat("ERR ", e.what());
  }
}

absl::StatusOr<double> MeasureGemmRate(bool bf16) {
  double gflops = 0;
  HIMOE_RETURN_IF_ERROR(CatchTorchErrors([&] {
    gflops = TimeGemm(ProbeMatrix(1024, 1024), ProbeMatrix(1024, 1024), kGemmRateSeconds, bf16);
    return absl::OkStatus();
  }));
  return gflops;
}

absl::StatusOr<double> MeasureGemmRateInFreshProcess(int threads, int blas_threads, bool bf16) {
  const std::string answer = RunInFreshProcess(
      kGemmRateProbeEnv,
      [&](int fd) { return absl::StrCat(threads, " ", fd, " ", bf16 ? 1 : 0); },
      {{kBlisThreadsEnv, std::to_string(blas_threads)}});
  std::string error;
  const double gflops = ParseProbeAnswer(answer, &error);
  if (!error.empty()) return absl::InternalError(absl::StrCat("GEMM rate probe: ", error));
  return gflops;
}

}  // namespace himoe
