#include "expert_service/expert_access.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "himoe/v1/expert.pb.h"

namespace himoe::expert {
namespace {

using Json = nlohmann::json;

Json Paths(std::initializer_list<const char*> methods) {
  Json paths = Json::array();
  for (const char* m : methods) paths.push_back(ExpertMethodPath(m));
  return paths;
}

}  // namespace

std::string ExpertMethodPath(absl::string_view method) {
  return absl::StrCat("/", v1::ExpertInfoRequest::descriptor()->file()->package(),
                      ".ExpertService/", method);
}

const std::vector<std::string>& ExpertServiceMethods() {
  static const std::vector<std::string>* const methods = [] {
    auto* out = new std::vector<std::string>();
    const auto* service =
        v1::ExpertInfoRequest::descriptor()->file()->FindServiceByName("ExpertService");
    for (int i = 0; i < service->method_count(); ++i) {
      out->push_back(ExpertMethodPath(service->method(i)->name()));
    }
    return out;
  }();
  return *methods;
}

absl::StatusOr<std::shared_ptr<const AccessPolicy>> ExpertAccessPolicy(
    const ExpertAccessOptions& o, std::vector<std::string>* warnings) {
  const bool roles = !o.trainer_identity.empty() || !o.router_identity.empty();
  if (!o.policy_file.empty()) {
    if (roles) {
      return absl::InvalidArgumentError(
          "--authz_policy: a policy file replaces --trainer_identity and --router_identity; "
          "give one or the other");
    }
    return AccessPolicy::FromFile(o.policy_file, ExpertServiceMethods());
  }
  if (roles) {
    if (!o.tls) {
      return absl::InvalidArgumentError(
          "--trainer_identity/--router_identity: identities come from client certificates; "
          "they need mutual TLS (--tls_ca, --tls_cert, --tls_key)");
    }
    if (o.trainer_identity.empty()) {
      return absl::InvalidArgumentError(
          "--trainer_identity: empty; with --router_identity, name the trainer's certificate "
          "too (no one could train otherwise)");
    }
    Json rules = Json::array();
    rules.push_back({{"name", "trainer"}, {"source", {{"principals", {o.trainer_identity}}}}});
    // Info (the shape and the weights fingerprint) for every certificate of
    // the CA: the launcher's readiness probes present the groups' own.
    rules.push_back({{"name", "info"},
                     {"source", {{"principals", {"*"}}}},
                     {"request", {{"paths", Paths({"Info"})}}}});
    if (!o.router_identity.empty()) {
      rules.push_back({{"name", "router"},
                       {"source", {{"principals", {o.router_identity}}}},
                       {"request", {{"paths", Paths({"Info", "Forward", "SetState"})}}}});
    }
    const Json policy = {{"name", "roles"}, {"allow_rules", rules}};
    return AccessPolicy::Parse(policy.dump(), "of the roles", ExpertServiceMethods());
  }
  if (o.tls) {
    warnings->push_back(
        "mutual TLS without roles: every certificate the CA signed may call every method, "
        "training and loading weights included; name the trainer (--trainer_identity) and "
        "the router (--router_identity)");
    return nullptr;
  }
  if (o.loopback) return nullptr;
  if (o.insecure_training) {
    warnings->push_back(
        "plaintext on a non-loopback address with --insecure_training: anyone who reaches "
        "this port may begin a run, step or replace the weights");
    return nullptr;
  }
  warnings->push_back(
      "plaintext on a non-loopback address: the training methods (BeginRun, Backward, Step, "
      "Abort, SetState, GetState, Forward with save_for_backward) are refused; serve with "
      "mutual TLS and roles, or pass --insecure_training on a network only the cluster reaches");
  const Json policy = {
      {"name", "plaintext serving"},
      {"allow_rules",
       {{{"name", "serving"}, {"request", {{"paths", Paths({"Info", "Forward"})}}}}}}};
  return AccessPolicy::Parse(policy.dump(), "for plaintext", ExpertServiceMethods());
}

}  // namespace himoe::expert
