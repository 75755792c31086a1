#ifndef HIMOE_COMMON_CPU_VECTOR_UNITS_H_
#define HIMOE_COMMON_CPU_VECTOR_UNITS_H_

#include <istream>

namespace himoe {

// Whether the CPU has a family of vector units: "avx512" (F, DQ, BW and VL,
// what BLIS's skx kernels need), "avx2" (with FMA); any other name asks for
// AVX.
bool CpuHas(const char* feature);

// fp32 lanes of the widest vector unit: 16 (AVX-512), 8 (AVX), else 4.
int Fp32VectorLanes();

// The largest "cpu MHz" of a /proc/cpuinfo text; 0 if there is none.
double MaxCpuMhz(std::istream& cpuinfo);

// threads x GHz x fp32 lanes x 2 (FMA) x 2 (FMA units); 0 when `mhz` <= 0.
double VectorPeakGflopsAt(int threads, double mhz, int lanes);

// The same from the CPU's flags (Fp32VectorLanes) and /proc/cpuinfo's clock
// (MaxCpuMhz); 0 when the clock is unknown.
double VectorPeakGflops(int threads);

}  // namespace himoe

#endif  // HIMOE_COMMON_CPU_VECTOR_UNITS_H_
