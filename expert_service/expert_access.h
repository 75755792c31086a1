#ifndef HIMOE_EXPERT_SERVICE_EXPERT_ACCESS_H_
#define HIMOE_EXPERT_SERVICE_EXPERT_ACCESS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/access_policy.h"

namespace himoe::expert {

// The full paths of the ExpertService methods ("/himoe.v1.ExpertService/Step").
const std::vector<std::string>& ExpertServiceMethods();
// "/himoe.v1.ExpertService/<method>". A Forward with save_for_backward is
// training: it is authorized as a Backward as well.
std::string ExpertMethodPath(absl::string_view method);

struct ExpertAccessOptions {
  // gRPC's authorization-policy JSON (AccessPolicy); replaces the roles.
  std::string policy_file;
  // Roles, by a principal of their certificates (a URI or DNS
  // subjectAltName): the trainer may call every method; the router Info,
  // Forward without save_for_backward, and SetState (it loads the model it
  // serves); any other certificate of the CA Info. Needs mutual TLS.
  std::string trainer_identity;
  std::string router_identity;
  bool tls = false;
  // The service listens on a loopback address only.
  bool loopback = false;
  // Plaintext on another address: answer the training methods anyway.
  bool insecure_training = false;
};

// The policy an expert service enforces, null when every caller may call
// every method; `warnings` get what a deployment should hear at start.
//  - a policy file, or the roles: that policy;
//  - mutual TLS without roles: null, with a warning (every certificate the
//    CA signed may train);
//  - plaintext on a loopback address: null;
//  - plaintext elsewhere: the training methods (BeginRun, Backward, Step,
//    Abort, SetState, GetState, Forward with save_for_backward) refused,
//    with a warning; null with --insecure_training, and a warning.
// InvalidArgument for a bad file, or roles without TLS or without a trainer.
absl::StatusOr<std::shared_ptr<const AccessPolicy>> ExpertAccessPolicy(
    const ExpertAccessOptions& options, std::vector<std::string>* warnings);

}  // namespace himoe::expert

#endif  // HIMOE_EXPERT_SERVICE_EXPERT_ACCESS_H_
