#include "common/small_product_choice.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>

#include <ATen/ATen.h>

#include "common/gemm_rate.h"
#include "common/linear.h"

namespace himoe {

int64_t RowwiseLinearRowsFor(double gemm_us, double small_rows_us) {
  return small_rows_us < gemm_us * 2 / 3 ? kRowwiseLinearRowsWhenFaster : 0;
}

SmallProductChoice ChooseSmallProducts() {
  const at::Tensor w = ProbeMatrix(1024, 256);
  const at::Tensor x = ProbeMatrix(4, 256);
  const auto best_us = [](const std::function<void()>& product) {
    product();  // warm-up
    double best = std::numeric_limits<double>::infinity();
    for (int rep = 0; rep < 15; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      product();
      best = std::min(best, std::chrono::duration<double>(
                                std::chrono::steady_clock::now() - start)
                                .count());
    }
    return 1e6 * best;
  };
  SmallProductChoice choice;
  choice.gemm_us = best_us([&] { at::linear(x, w); });
  choice.small_rows_us = best_us([&] { SmallRowsLinear(x, w, at::Tensor()); });
  choice.rowwise_linear_rows = RowwiseLinearRowsFor(choice.gemm_us, choice.small_rows_us);
  SetRowwiseLinearRows(choice.rowwise_linear_rows);
  return choice;
}

}  // namespace himoe
