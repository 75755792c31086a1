#ifndef HIMOE_COMMON_GEMM_RATE_H_
#define HIMOE_COMMON_GEMM_RATE_H_

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace himoe {

// How long the GEMM rate is measured, in seconds.
inline constexpr double kGemmRateSeconds = 0.3;
// The request that makes this program, started again, answer with the GEMM
// rate before main: "<threads> <fd> <bf16 0|1>".
inline constexpr char kGemmRateProbeEnv[] = "HIMOE_GEMM_RATE_PROBE";

// A [rows, cols] matrix of N(0,1) values from the probes' own generator (the
// global one seeds the model).
at::Tensor ProbeMatrix(int64_t rows, int64_t cols);

// Best rate, in GFLOP/s, of a @ b over repeated products for about `seconds`
// (at least 3); with `bf16`, MatmulBf16Out's products.
double TimeGemm(const at::Tensor& a, const at::Tensor& b, double seconds, bool bf16 = false);

// Largest |c - a@b| over the first `rows` x `cols` entries, against double sums.
double MaxGemmError(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                    int64_t rows, int64_t cols);

// A probe's body: times a `rows` x `inner` x `cols` product on `threads`
// threads and checks its first rows; "OK <GFLOP/s>" or "ERR <why>" (a wrong
// result, a LibTorch error).
std::string RunGemmProbe(int threads, int64_t rows, int64_t inner, int64_t cols,
                         double seconds, bool bf16 = false);

// The machine's GEMM rate: [1024,1024] products for kGemmRateSeconds on this
// process's threads.
absl::StatusOr<double> MeasureGemmRate(bool bf16);

// The same on `threads` threads (`blas_threads` BLIS threads), which needs a
// process whose OpenMP and BLIS start fresh: this program, started again
// with HIMOE_GEMM_RATE_PROBE.
absl::StatusOr<double> MeasureGemmRateInFreshProcess(int threads, int blas_threads, bool bf16);

}  // namespace himoe

#endif  // HIMOE_COMMON_GEMM_RATE_H_
