#ifndef HIMOE_COMMON_BLAS_LIBRARY_H_
#define HIMOE_COMMON_BLAS_LIBRARY_H_

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace himoe {

// BLIS is steered through its environment, read once, at its first call.
inline constexpr char kBlisArchEnv[] = "BLIS_ARCH_TYPE";
inline constexpr char kBlisThreadsEnv[] = "BLIS_NUM_THREADS";

// The BLAS that runs LibTorch's CPU GEMMs, for the log. `loaded_path`: the
// libblas.so / libopenblas loaded in the process (resolved), empty if none;
// then the BLAS is inside LibTorch (pip's wheels link MKL statically), named
// from `has_mkl` (at::hasMKL()) or else `torch_config`'s BLAS_INFO
// (at::show_config()).
std::string BlasDisplayName(const std::string& loaded_path, bool has_mkl,
                            const std::string& torch_config);

// The BLAS library loaded in this process. Debian's BLIS builds live in
// blis-{openmp,pthread,serial}/; their libblas.so.3 exports the BLAS symbols
// only, so BLIS is steered through its environment (BLIS_ARCH_TYPE,
// BLIS_NUM_THREADS).
struct BlasLibrary {
  std::string path;            // the loaded libblas.so.3, resolved; empty: none
  std::string blis_threading;  // "openmp", "pthread" or "serial"; empty: not BLIS

  static BlasLibrary Find();
  // The path that names a BLIS build, or any other.
  static BlasLibrary AtPath(const std::string& path);
  bool blis() const { return !blis_threading.empty(); }
  // "BLIS (<threading>)", or BlasDisplayName of the loaded library. With none
  // loaded the BLAS is inside LibTorch, which only LibTorch can name
  // (BlasDisplayName with at::hasMKL() and at::show_config()).
  std::string Name() const;
};

// Asks libblis.so.4 (the same code as the libblas.so.3 BLIS builds) for its
// own kernel choice on this CPU and the ids of its kernel sets, which
// BLIS_ARCH_TYPE takes (BLIS 0.9 reads a number; a name reads as 0):
// "OK <choice> <name>=<id> ...", else "ERR <why>". Call it in a child
// (RunInChild): the query fixes the choice of the library it loads.
std::string BlisKernelSets();

// BlisKernelSets()'s answer, parsed; nullopt for an "ERR" answer.
struct BlisKernelTable {
  std::string choice;                      // BLIS's own choice on this CPU
  std::map<std::string, std::string> ids;  // kernel set name -> BLIS_ARCH_TYPE value
};
std::optional<BlisKernelTable> ParseBlisKernelTable(const std::string& answer);

// Kernel sets this CPU can run, fastest family first (BLIS names).
std::vector<std::string> CandidateBlisKernels();

}  // namespace himoe

#endif  // HIMOE_COMMON_BLAS_LIBRARY_H_
