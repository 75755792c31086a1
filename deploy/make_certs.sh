#!/usr/bin/env bash
# Makes a cluster's mutual-TLS certificates with openssl, one per workload,
# in directory DIR:
#   ca.pem/.key        the cluster's CA (keep ca.key off the cluster)
#   expert.pem/.key    the expert groups: server and client,
#                      URI:spiffe://himoe/expert
#   router.pem/.key    the router: server and client, URI:spiffe://himoe/router
#   trainer.pem/.key   the trainer: client, URI:spiffe://himoe/trainer
# Every server certificate names the hosts it is dialed by: 127.0.0.1 and
# localhost, and each HOST given (an IP address or a DNS name; a Kubernetes
# cluster: "*.himoe-expert.himoe.svc.cluster.local" and
# "himoe-router.himoe.svc.cluster.local").
#
#   deploy/make_certs.sh DIR [HOST...]
#   HIMOE_CERT_DAYS=N   validity (default 365)
# The identities go in the cluster file's tls.trainer / tls.router, or to
# himoe-expert as --trainer_identity / --router_identity.
set -euo pipefail
[[ $# -ge 1 ]] || { echo "usage: $0 DIR [HOST...]" >&2; exit 2; }
dir="$1"
shift
days="${HIMOE_CERT_DAYS:-365}"
hosts="IP:127.0.0.1,DNS:localhost"
for h in "$@"; do
  if [[ "${h}" =~ ^[0-9.]+$ || "${h}" == *:* ]]; then
    hosts+=",IP:${h}"
  else
    hosts+=",DNS:${h}"
  fi
done
mkdir -p "${dir}"
cd "${dir}"
umask 077
if [[ ! -s ca.pem ]]; then
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days "${days}" \
    -subj "/CN=himoe cluster CA" 2>/dev/null
fi
# leaf NAME SAN USAGE: a certificate of the CA for workload NAME.
leaf() {
  openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=himoe $1" \
    2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=%s\n' "$2" "$3" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days "${days}" \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
leaf expert "${hosts},URI:spiffe://himoe/expert" serverAuth,clientAuth
leaf router "${hosts},URI:spiffe://himoe/router" serverAuth,clientAuth
leaf trainer "URI:spiffe://himoe/trainer" clientAuth
chmod 0644 ca.pem expert.pem router.pem trainer.pem
echo "certificates in ${PWD}: ca.pem; expert, router, trainer (.pem, .key)"
