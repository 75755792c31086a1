#!/usr/bin/env bash
# --experts=local with --tls_ca/--tls_cert/--tls_key: the trainer starts its
# expert processes with mutual TLS and trains through it, ending with the
# weights of the same run in plaintext.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
trainer="${HIMOE_BUILD_DIR}/trainer/himoe-trainer"
out="$(mktemp -d)"
trap 'rm -rf "${out}"' EXIT
bash "${root}/tests/router_service/make_test_certs.sh" "${out}/certs"
flags=(--experts=local --n_layer 2 --d_model 32 --d_ff 64 --dense_ff 64 --n_head 2
       --block_size 32 --batch_size 4 --steps 6 --eval_every 6 --eval_windows 4
       --checkpoint_every 6 --log_every 100 --blas_probe=false)
"${trainer}" "${flags[@]}" --out_dir "${out}/tls" --tls_ca "${out}/certs/ca.pem" \
  --tls_cert "${out}/certs/server.pem" --tls_key "${out}/certs/server.key" \
  2>"${out}/tls.log" || { cat "${out}/tls.log"; exit 1; }
for g in 0 1 2 3; do
  grep -q -- "--tls_ca=${out}/certs/ca.pem --tls_cert=${out}/certs/server.pem" \
    "${out}/tls/experts/expert-${g}.log"
done
"${trainer}" "${flags[@]}" --out_dir "${out}/plain" 2>"${out}/plain.log" || { cat "${out}/plain.log"; exit 1; }
grep -q -- "--tls_ca" "${out}/plain/experts/expert-0.log" && exit 1
final=checkpoints/step_00000006
for f in dense.pt experts_g0.pt experts_g1.pt experts_g2.pt experts_g3.pt; do
  cmp "${out}/tls/${final}/${f}" "${out}/plain/${final}/${f}"
done
if pgrep -f -- "${out}" >/dev/null; then
  echo "expert processes left behind" >&2
  exit 1
fi
echo "TLS local training test passed"
