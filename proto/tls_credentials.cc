#include "proto/tls_credentials.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/auth_context.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace himoe {
namespace {

// The PEM text of `path`; `field` names it in errors, `marker` is what a PEM
// block of the expected kind contains ("CERTIFICATE", "PRIVATE KEY").
absl::StatusOr<std::string> ReadPem(const std::string& field, const std::string& path,
                                    const char* marker) {
  if (path.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": empty; TLS needs the CA, the certificate and the key"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(field, ": cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  std::string pem = text.str();
  if (!absl::StrContains(pem, "-----BEGIN") || !absl::StrContains(pem, marker)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", path, " holds no PEM ", marker, " block"));
  }
  return pem;
}

struct Pems {
  std::string ca, cert, key;
};

absl::StatusOr<Pems> ReadAll(const TlsFiles& tls) {
  Pems p;
  auto ca = ReadPem("tls ca_file", tls.ca_file, "CERTIFICATE");
  if (!ca.ok()) return ca.status();
  auto cert = ReadPem("tls cert_file", tls.cert_file, "CERTIFICATE");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem("tls key_file", tls.key_file, "PRIVATE KEY");
  if (!key.ok()) return key.status();
  p.ca = *std::move(ca);
  p.cert = *std::move(cert);
  p.key = *std::move(key);
  return p;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  auto pems = ReadAll(tls);
  if (!pems.ok()) return pems.status();
  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = pems->ca;
  options.pem_key_cert_pairs.push_back({pems->key, pems->cert});
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  auto pems = ReadAll(tls);
  if (!pems.ok()) return pems.status();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = pems->ca;
  options.pem_private_key = pems->key;
  options.pem_cert_chain = pems->cert;
  return grpc::SslCredentials(options);
}

Caller CallerOf(const grpc::ServerContextBase& context) {
  Caller caller;
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return caller;
  caller.authenticated = true;
  for (const char* property : {GRPC_PEER_URI_PROPERTY_NAME, GRPC_PEER_DNS_PROPERTY_NAME,
                               GRPC_X509_SUBJECT_PROPERTY_NAME}) {
    for (const grpc::string_ref& value : auth->FindPropertyValues(property)) {
      caller.principals.emplace_back(value.data(), value.size());
    }
  }
  return caller;
}

}  // namespace himoe
