#!/usr/bin/env bash
# Test certificates for mutual TLS, made with openssl in directory $1:
#   ca.pem/.key          the cluster's CA
#   expert, router, trainer .pem/.key   deploy/make_certs.sh's, one per role
#                        (URI:spiffe://himoe/<role>)
#   server.pem/.key      signed by the CA, subjectAltName IP:127.0.0.1, DNS:localhost
#   client.pem/.key      signed by it, the same names and no role
#   stranger.pem/.key    signed by another CA (other_ca.pem)
#   expired.pem/.key     signed by the CA, valid until yesterday
set -euo pipefail
dir="$1"
HIMOE_CERT_DAYS=30 bash "$(dirname "${BASH_SOURCE[0]}")/../../deploy/make_certs.sh" "${dir}" \
  >/dev/null
cd "${dir}"
ca() {  # name subject
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.pem" -days 30 \
    -subj "/CN=$2" 2>/dev/null
}
leaf() {  # name ca days
  openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=himoe $1" \
    2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n' \
    >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -days "$3" \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
ca other_ca "another CA"
leaf server ca 30
leaf client ca 30
leaf stranger other_ca 30
leaf expired ca -1
