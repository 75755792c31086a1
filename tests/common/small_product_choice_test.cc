#include "common/small_product_choice.h"

#include "common/linear.h"
#include "gtest/gtest.h"

namespace himoe {
namespace {

// The small-rows path is taken exactly under 2/3 of the GEMM's time.
TEST(SmallProductChoiceTest, TheSmallRowsPathNeedsAThirdLessTime) {
  EXPECT_EQ(RowwiseLinearRowsFor(150, 29), kRowwiseLinearRowsWhenFaster);
  EXPECT_EQ(RowwiseLinearRowsFor(90, 59.9), kRowwiseLinearRowsWhenFaster);
  EXPECT_EQ(RowwiseLinearRowsFor(90, 60), 0);
  EXPECT_EQ(RowwiseLinearRowsFor(30, 40), 0);
}

// Small products take the small-rows path exactly when it measured under 2/3
// of the 4-row GEMM, and himoe::Linear follows the choice.
TEST(SmallProductChoiceTest, SmallProductsGoRowwiseOnlyWhereMeasuredFaster) {
  const SmallProductChoice choice = ChooseSmallProducts();
  EXPECT_GT(choice.gemm_us, 0);
  EXPECT_GT(choice.small_rows_us, 0);
  EXPECT_EQ(choice.rowwise_linear_rows,
            RowwiseLinearRowsFor(choice.gemm_us, choice.small_rows_us));
  EXPECT_EQ(RowwiseLinearRows(), choice.rowwise_linear_rows);
}

}  // namespace
}  // namespace himoe
