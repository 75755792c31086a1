#ifndef HIMOE_COMMON_BLIS_KERNEL_CACHE_H_
#define HIMOE_COMMON_BLIS_KERNEL_CACHE_H_

#include <istream>
#include <map>
#include <string>

#include "absl/status/status.h"

namespace himoe {

// The file that keeps the kernel probe's choice for the next start on this
// CPU and BLIS: two lines, the key (KernelCacheKey) and the kernel set.

// The kernel cache of this user: $HIMOE_CACHE_DIR/blis-kernels (an empty
// HIMOE_CACHE_DIR: none), else $XDG_CACHE_HOME/himoe/..., else
// $HOME/.cache/himoe/...
std::string DefaultKernelCacheFile();

// What a cached kernel choice is valid for: this CPU (its /proc/cpuinfo
// identity and flags) and this BLIS (`blis_table`, BlisKernelSets()'s
// answer).
std::string KernelCacheKey(const std::string& blis_table);
// The same from a /proc/cpuinfo text: its first processor's vendor, family,
// model, model name and stepping, and a hash of its flags.
std::string KernelCacheKeyFor(std::istream& cpuinfo, const std::string& blis_table);

// The cached choice for `key`, or empty (no path, no file, another key, or a
// kernel set not in `ids`, the kernel sets BLIS lists).
std::string ReadCachedKernels(const std::string& path, const std::string& key,
                              const std::map<std::string, std::string>& ids);

// Writes `kernels` under `key` to `path` (atomically), creating its folder.
absl::Status WriteCachedKernels(const std::string& path, const std::string& key,
                                const std::string& kernels);

}  // namespace himoe

#endif  // HIMOE_COMMON_BLIS_KERNEL_CACHE_H_
