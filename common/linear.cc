#include "common/linear.h"

#include <atomic>
#include <vector>

#include <ATen/ATen.h>

namespace himoe {
namespace {
std::atomic<int64_t> rowwise_rows{0};
}  // namespace

int64_t RowwiseLinearRows() { return rowwise_rows.load(std::memory_order_relaxed); }
void SetRowwiseLinearRows(int64_t rows) { rowwise_rows.store(rows, std::memory_order_relaxed); }

at::Tensor Linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t rows = x.dim() == 2 ? x.size(0) : 0;
  if (rows < 1 || rows >= RowwiseLinearRows() || !x.is_cpu()) {
    return at::linear(x, weight, bias);
  }
  std::vector<at::Tensor> out;
  out.reserve(rows);
  for (int64_t i = 0; i < rows; ++i) {
    out.push_back(bias.defined() ? at::addmv(bias, weight, x[i]) : at::mv(weight, x[i]));
  }
  return at::stack(out);
}

}  // namespace himoe
