#include "common/cpu_vector_units.h"

#include <algorithm>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"

namespace himoe {

bool CpuHas(const char* feature) {
  __builtin_cpu_init();
  if (std::string(feature) == "avx512") {
    return __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }
  if (std::string(feature) == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  return __builtin_cpu_supports("avx");
}

int Fp32VectorLanes() { return CpuHas("avx512") ? 16 : CpuHas("avx") ? 8 : 4; }

double MaxCpuMhz(std::istream& cpuinfo) {
  std::string line;
  double mhz = 0;
  while (std::getline(cpuinfo, line)) {
    if (!absl::StartsWith(line, "cpu MHz")) continue;
    const size_t colon = line.find(':');
    double value = 0;
    if (colon != std::string::npos &&
        absl::SimpleAtod(absl::StripAsciiWhitespace(line.substr(colon + 1)),
                         &value)) {
      mhz = std::max(mhz, value);
    }
  }
  return mhz;
}

double VectorPeakGflopsAt(int threads, double mhz, int lanes) {
  if (mhz <= 0) return 0;
  return threads * mhz / 1000.0 * lanes * 2 * 2;
}

double VectorPeakGflops(int threads) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  return VectorPeakGflopsAt(threads, MaxCpuMhz(cpuinfo), Fp32VectorLanes());
}

}  // namespace himoe
