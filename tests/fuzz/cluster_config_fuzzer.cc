// The cluster-file parser on arbitrary text: an error or a validated config,
// never a crash; a config it accepts prints and parses back to itself.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <google/protobuf/text_format.h>
#include <google/protobuf/util/message_differencer.h>

#include "common/cluster_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = himoe::ParseClusterConfig(text, "fuzz");
  if (!config.ok()) return 0;
  std::string printed;
  if (!google::protobuf::TextFormat::PrintToString(*config, &printed)) std::abort();
  auto again = himoe::ParseClusterConfig(printed, "fuzz (printed)");
  if (!again.ok() ||
      !google::protobuf::util::MessageDifferencer::Equals(*config, *again)) {
    std::abort();
  }
  return 0;
}
