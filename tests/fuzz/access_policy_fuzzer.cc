// An authorization policy (gRPC's JSON form) from arbitrary bytes: an error
// naming the field, or a policy whose decisions are defined for any caller,
// never a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/access_policy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<std::string> methods = {"/pkg.S/Info", "/pkg.S/Step", "/pkg.S/Forward"};
  const std::string json(reinterpret_cast<const char*>(data), size);
  auto policy = himoe::AccessPolicy::Parse(json, "fuzz", methods);
  if (!policy.ok()) {
    if (policy.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  himoe::Caller anonymous;
  himoe::Caller named;
  named.authenticated = true;
  named.principals = {"spiffe://himoe/trainer", json.substr(0, 32)};
  for (const std::string& path : methods) {
    for (const himoe::Caller* caller : {&anonymous, &named}) {
      const absl::Status s = (*policy)->Check(path, *caller);
      if (!s.ok() && s.code() != absl::StatusCode::kPermissionDenied) std::abort();
    }
  }
  return 0;
}
