// A checkpoint's MANIFEST and meta.textproto readers on arbitrary bytes: the
// input is split at the first NUL into a MANIFEST and a meta text. Errors or
// values, never a crash; every MANIFEST entry it accepts is well formed.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "model/checkpoint_reader.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t cut = input.find('\0');
  const std::string manifest = input.substr(0, cut);
  const std::string meta = cut == std::string::npos ? "" : input.substr(cut + 1);
  auto entries = himoe::model::ParseManifest(manifest, "fuzz");
  if (entries.ok()) {
    for (const auto& e : *entries) {
      if (e.sha256.size() != 64 || e.name.empty() || e.name.find('/') != std::string::npos) {
        std::abort();
      }
    }
  }
  auto config = himoe::model::ParseCheckpointMeta(meta, "fuzz");
  if (config.ok() && config->step() < 0) std::abort();
  return 0;
}
