#ifndef HIMOE_COMMON_TLS_FILES_H_
#define HIMOE_COMMON_TLS_FILES_H_

#include <string>

namespace himoe {

// PEM files for mutual TLS: the CA that signs every peer, and this process's
// certificate chain and private key. All empty = plaintext; otherwise all
// three are needed (proto/tls_credentials.h makes gRPC credentials of them).
struct TlsFiles {
  std::string ca_file;
  std::string cert_file;
  std::string key_file;
  bool enabled() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};

}  // namespace himoe

#endif  // HIMOE_COMMON_TLS_FILES_H_
