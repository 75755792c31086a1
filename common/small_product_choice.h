#ifndef HIMOE_COMMON_SMALL_PRODUCT_CHOICE_H_
#define HIMOE_COMMON_SMALL_PRODUCT_CHOICE_H_

#include <cstdint>

namespace himoe {

// Whether himoe::Linear runs few-row products through SmallRowsLinear
// (RowwiseLinearRows) on this machine: kernel sets without BLIS's
// small-matrix path pack the whole weight for every GEMM.
struct SmallProductChoice {
  // A [4,256]x[256,1024] product (an expert's first matrix on a decoding
  // step's rows) as one GEMM and as SmallRowsLinear, microseconds, best of
  // several.
  double gemm_us = 0, small_rows_us = 0;
  int64_t rowwise_linear_rows = 0;  // the RowwiseLinearRows() chosen
};

// kRowwiseLinearRowsWhenFaster where the small-rows product takes under 2/3
// of the GEMM's time, else 0.
int64_t RowwiseLinearRowsFor(double gemm_us, double small_rows_us);

// Times both and has himoe::Linear follow the choice (SetRowwiseLinearRows).
SmallProductChoice ChooseSmallProducts();

}  // namespace himoe

#endif  // HIMOE_COMMON_SMALL_PRODUCT_CHOICE_H_
