#ifndef HIMOE_COMMON_ACCESS_POLICY_H_
#define HIMOE_COMMON_ACCESS_POLICY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace himoe {

// A caller, as its transport authenticated it.
struct Caller {
  // Presented a certificate the server's CA signed (mutual TLS).
  bool authenticated = false;
  // Its certificate's URI subjectAltNames, then its DNS ones, then its
  // subject; empty without a certificate.
  std::vector<std::string> principals;
};

// Which methods of a service which callers may call: gRPC's authorization
// policy (gRFC A43), in its JSON form:
//
//   {"name": "experts",
//    "deny_rules":  [ RULE, ... ],                // optional
//    "allow_rules": [ RULE, ... ]}                // at least one
//   RULE: {"name": "training",
//          "source":  {"principals": ["spiffe://himoe/trainer"]},  // optional
//          "request": {"paths": ["/himoe.v1.ExpertService/Step"]}} // optional
//
// A call is refused when a deny rule matches it, else answered when an allow
// rule does. A rule without `source` matches every caller, one without
// `request` every method. A principal or path of "*" matches any (a
// principal "*": any authenticated caller); one ending in "*" matches by
// prefix. Request headers are not supported.
class AccessPolicy {
 public:
  // `methods`: the service's full method paths; a path that matches none of
  // them is refused, as are unknown keys. Errors are InvalidArgument naming
  // `source` and the JSON field, e.g. "allow_rules[1].request.paths[0]".
  static absl::StatusOr<std::shared_ptr<const AccessPolicy>> Parse(
      absl::string_view json, absl::string_view source, absl::Span<const std::string> methods);
  static absl::StatusOr<std::shared_ptr<const AccessPolicy>> FromFile(
      const std::string& path, absl::Span<const std::string> methods);

  // OK, or PermissionDenied naming `path`, the caller's principals and the
  // policy.
  absl::Status Check(absl::string_view path, const Caller& caller) const;

  const std::string& name() const { return name_; }

 private:
  struct Rule {
    std::string name;
    bool any_source = true;
    std::vector<std::string> principals;
    bool any_path = true;
    std::vector<std::string> paths;
  };
  static bool Matches(const Rule& rule, absl::string_view path, const Caller& caller);

  std::string name_;
  std::vector<Rule> deny_;
  std::vector<Rule> allow_;
};

}  // namespace himoe

#endif  // HIMOE_COMMON_ACCESS_POLICY_H_
