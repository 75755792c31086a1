#include "common/blas_library.h"

#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <stdlib.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/cpu_vector_units.h"

namespace himoe {
namespace {

// The loaded libblas.so.3, resolved through the alternatives symlinks.
std::string LoadedBlasPath() {
  std::string found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        const std::string name = info->dlpi_name ? info->dlpi_name : "";
        if (name.find("libblas.so") == std::string::npos &&
            name.find("libopenblas") == std::string::npos) {
          return 0;
        }
        char resolved[PATH_MAX];
        *static_cast<std::string*>(data) =
            realpath(name.c_str(), resolved) ? resolved : name;
        return 1;
      },
      &found);
  return found;
}

}  // namespace

std::string BlasDisplayName(const std::string& loaded_path, bool has_mkl,
                            const std::string& torch_config) {
  if (absl::StrContains(loaded_path, "/blis-")) return "BLIS";
  if (absl::StrContains(loaded_path, "openblas")) return "OpenBLAS";
  if (absl::StrContains(loaded_path, "/blas/")) return "reference BLAS";
  if (!loaded_path.empty()) return loaded_path;
  if (has_mkl) return "MKL (inside LibTorch)";
  constexpr char kKey[] = "BLAS_INFO=";
  const size_t at = torch_config.find(kKey);
  if (at != std::string::npos) {
    const size_t begin = at + sizeof(kKey) - 1;
    const size_t end = torch_config.find_first_of(", \n", begin);
    const std::string info = torch_config.substr(begin, end - begin);
    if (!info.empty() && info != "generic") return absl::StrCat(info, " (inside LibTorch)");
  }
  return "no BLAS library (LibTorch's own GEMM)";
}

BlasLibrary BlasLibrary::Find() { return AtPath(LoadedBlasPath()); }

BlasLibrary BlasLibrary::AtPath(const std::string& path) {
  BlasLibrary lib;
  lib.path = path;
  for (const char* threading : {"openmp", "pthread", "serial"}) {
    if (lib.path.find(absl::StrCat("/blis-", threading, "/")) != std::string::npos) {
      lib.blis_threading = threading;
    }
  }
  return lib;
}

std::string BlasLibrary::Name() const {
  if (blis()) return absl::StrCat("BLIS (", blis_threading, ")");
  return BlasDisplayName(path, false, "");
}

std::string BlisKernelSets() {
  void* handle = dlopen("libblis.so.4", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return "ERR libblis.so.4 not found";
  auto id = reinterpret_cast<int (*)()>(dlsym(handle, "bli_arch_query_id"));
  auto name = reinterpret_cast<const char* (*)(int)>(dlsym(handle, "bli_arch_string"));
  if (!id || !name) return "ERR libblis.so.4 lacks bli_arch_query_id";
  std::string answer = absl::StrCat("OK ", name(id()));
  for (int i = 0; i < 64; ++i) {
    const char* set = name(i);
    if (set == nullptr) break;
    absl::StrAppend(&answer, " ", set, "=", i);
    if (std::string(set) == "generic") break;  // the last of arch_t
  }
  return answer;
}

std::optional<BlisKernelTable> ParseBlisKernelTable(const std::string& answer) {
  const std::vector<std::string> words = absl::StrSplit(answer, ' ', absl::SkipEmpty());
  if (words.size() < 2 || words[0] != "OK") return std::nullopt;
  BlisKernelTable table;
  table.choice = words[1];
  for (size_t i = 2; i < words.size(); ++i) {
    const std::pair<std::string, std::string> kv = absl::StrSplit(words[i], '=');
    table.ids[kv.first] = kv.second;
  }
  return table;
}

std::vector<std::string> CandidateBlisKernels() {
  std::vector<std::string> names;
  if (CpuHas("avx512")) names.push_back("skx");
  if (CpuHas("avx2")) {
    names.push_back("zen3");
    names.push_back("haswell");
  }
  if (CpuHas("avx")) names.push_back("sandybridge");
  names.push_back("generic");
  return names;
}

}  // namespace himoe
