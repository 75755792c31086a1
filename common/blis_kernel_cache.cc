#include "common/blis_kernel_cache.h"

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/file_util.h"

namespace himoe {

std::string DefaultKernelCacheFile() {
  std::string dir;
  if (const char* d = std::getenv("HIMOE_CACHE_DIR"); d != nullptr) {
    dir = d;  // empty: no cache
  } else if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg) {
    dir = absl::StrCat(xdg, "/himoe");
  } else if (const char* home = std::getenv("HOME"); home != nullptr && *home) {
    dir = absl::StrCat(home, "/.cache/himoe");
  }
  return dir.empty() ? "" : absl::StrCat(dir, "/blis-kernels");
}

std::string KernelCacheKey(const std::string& blis_table) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  return KernelCacheKeyFor(cpuinfo, blis_table);
}

std::string KernelCacheKeyFor(std::istream& cpuinfo, const std::string& blis_table) {
  std::string line, identity;
  uint64_t flags_hash = 14695981039346656037ull;  // FNV-1a of the flags line
  while (std::getline(cpuinfo, line) && !line.empty()) {  // the first processor
    const std::string field(absl::StripAsciiWhitespace(line.substr(0, line.find(':'))));
    const std::string value(
        absl::StripAsciiWhitespace(line.find(':') == std::string::npos
                                       ? ""
                                       : line.substr(line.find(':') + 1)));
    if (field == "vendor_id" || field == "cpu family" || field == "model" ||
        field == "model name" || field == "stepping") {
      absl::StrAppend(&identity, field, "=", value, ";");
    } else if (field == "flags") {
      for (const unsigned char c : value) flags_hash = (flags_hash ^ c) * 1099511628211ull;
    }
  }
  return absl::StrCat("cpu ", identity, " flags ", absl::Hex(flags_hash), " | blis ",
                      blis_table);
}

std::string ReadCachedKernels(const std::string& path, const std::string& key,
                              const std::map<std::string, std::string>& ids) {
  if (path.empty()) return "";
  std::ifstream in(path);
  std::string cached_key, kernels;
  if (!std::getline(in, cached_key) || !std::getline(in, kernels)) return "";
  if (cached_key != key || ids.count(kernels) == 0) return "";
  return kernels;
}

absl::Status WriteCachedKernels(const std::string& path, const std::string& key,
                                const std::string& kernels) {
  if (path.rfind('/') != std::string::npos) {
    CreateDirectories(Dirname(path)).IgnoreError();
  }
  return WriteFileAtomically(path, absl::StrCat(key, "\n", kernels, "\n"));
}

}  // namespace himoe
