#include "common/squared_norm.h"

#include <algorithm>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/parallel_for.h"

namespace himoe {

double SquaredNorm(const at::Tensor& t) {
  const at::Tensor d = t.detach();
  if (!d.device().is_cpu() || d.scalar_type() != at::kFloat) {
    return d.to(at::kDouble).square().sum().item<double>();
  }
  const at::Tensor c = d.contiguous();
  const float* x = c.data_ptr<float>();
  const int64_t n = c.numel();
  const int64_t blocks = (n + kSquaredNormBlock - 1) / kSquaredNormBlock;
  std::vector<double> sums(blocks, 0.0);
  ParallelForRange(0, blocks, 1, at::get_num_threads(), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t first = b * kSquaredNormBlock;
      const int64_t last = std::min(n, first + kSquaredNormBlock);
      // Eight running sums (element i into sum i mod 8): independent chains
      // the compiler can keep in vector registers.
      double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = first;
      for (; i + 8 <= last; i += 8) {
        for (int j = 0; j < 8; ++j) s[j] += static_cast<double>(x[i + j]) * x[i + j];
      }
      for (int j = 0; i < last; ++i, ++j) s[j] += static_cast<double>(x[i]) * x[i];
      sums[b] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    }
  });
  double total = 0;
  for (const double s : sums) total += s;
  return total;
}

}  // namespace himoe
