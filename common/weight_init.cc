#include "common/weight_init.h"

#include <cmath>

namespace himoe {

void TruncatedNormal_(at::Tensor& t, double std, at::Generator& gen) {
  // Standard normal CDF at +-2, then erfinv maps U(Phi(-2), Phi(2)) back.
  const double lo = std::erf(-2.0 / std::sqrt(2.0)), hi = -lo;
  t.uniform_(lo, hi, gen).erfinv_().mul_(std * std::sqrt(2.0)).clamp_(-2 * std, 2 * std);
}

void SwitchInit_(at::Tensor& t, int64_t fan_in, at::Generator& gen) {
  TruncatedNormal_(t, std::sqrt(kSwitchInitScale / static_cast<double>(fan_in)), gen);
}

double ResidualInitStd(int n_layer) { return 0.02 / std::sqrt(2.0 * n_layer); }

}  // namespace himoe
