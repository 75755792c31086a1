// A test parameterized by himoe::RowwiseLinearRows() (common/linear.h): set
// for each test, restored after it, so one test covers both few-row product
// paths (0: BLAS GEMMs; kRowwiseLinearRowsWhenFaster: the small-rows loop).
#ifndef HIMOE_TESTS_ROWWISE_ROWS_TEST_H_
#define HIMOE_TESTS_ROWWISE_ROWS_TEST_H_

#include <cstdint>

#include "common/linear.h"
#include "gtest/gtest.h"

namespace himoe::test_util {

class RowwiseRowsTest : public ::testing::TestWithParam<int64_t> {
 protected:
  void SetUp() override {
    saved_ = RowwiseLinearRows();
    SetRowwiseLinearRows(GetParam());
  }
  void TearDown() override { SetRowwiseLinearRows(saved_); }

 private:
  int64_t saved_ = 0;
};

}  // namespace himoe::test_util

#endif  // HIMOE_TESTS_ROWWISE_ROWS_TEST_H_
