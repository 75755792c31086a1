#ifndef HIMOE_PROTO_TLS_CREDENTIALS_H_
#define HIMOE_PROTO_TLS_CREDENTIALS_H_

#include <memory>
#include <string>

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>

#include "absl/status/statusor.h"
#include "common/access_policy.h"
#include "common/tls_files.h"

namespace himoe {

// Server side. With TLS the port speaks TLS only (plaintext clients fail the
// handshake), and every client must present a certificate signed by the CA,
// which is verified. Errors name the file and what is wrong with it.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& tls);

// Client side: the server's certificate must be signed by the CA and name the
// host dialed (subjectAltName); this process presents its own certificate.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& tls);

// Who makes a call this server serves, from its TLS handshake: principals
// are its certificate's URI SANs, DNS SANs, then its subject.
Caller CallerOf(const grpc::ServerContextBase& context);

}  // namespace himoe

#endif  // HIMOE_PROTO_TLS_CREDENTIALS_H_
