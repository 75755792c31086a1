#!/usr/bin/env bash
# The real binaries open their /metrics endpoint beside libraries whose static
# TLS exceeds civetweb's 100 KiB thread stacks (LD_PRELOAD of a library holding
# 256 KiB of initial-exec TLS, more than a CUDA LibTorch's libraries hold: see
# docs/benchmarks.md, Measurements behind choices in the code): each must
# export the endpoint's pthread_attr_setstacksize. Without it, every binary's
# endpoint fails beside a CUDA LibTorch ("null context when constructing
# CivetServer").
#   metrics_beside_big_tls_test.sh HIMOE_EXPERT HIMOE_ROUTER HIMOE_TRAINER BIG_TLS_LIBRARY
set -uo pipefail
expert="$1" router="$2" trainer="$3" big="$4"
tmp="$(mktemp -d)"
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait; rm -rf "${tmp}"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# served NAME: the binary logging to ${tmp}/NAME.log wrote its "<grpc port>
# <metrics port>" to ${tmp}/NAME.port, and its /metrics lists a himoe_NAME_
# metric (the body is read whole first: grep -q would close a pipe on curl,
# which pipefail then reports). Sets grpc_port.
served() {
  local file="${tmp}/$1.port" metrics body
  for _ in $(seq 300); do [[ -s "${file}" ]] && break; sleep 0.1; done
  if [[ ! -s "${file}" ]]; then
    fail "himoe-$1 did not start: $(tail -1 "${tmp}/$1.log")"
    return 1
  fi
  read -r grpc_port metrics <"${file}"
  body="$(curl -sS "http://127.0.0.1:${metrics}/metrics" 2>&1)"
  grep -q "^himoe_$1_" <<<"${body}" ||
    fail "no himoe_$1_ metric on port ${metrics}: $(head -c 300 <<<"${body}")"
}

LD_PRELOAD="${big}" "${expert}" --address=127.0.0.1:0 --group_id=0 --num_groups=1 \
  --num_experts=2 --num_layers=1 --d_model=16 --d_ff=16 --seed=1 --threads=1 --metrics_port=0 \
  --metrics_address=127.0.0.1 --port_file="${tmp}/expert.port" >"${tmp}/expert.log" 2>&1 &
pids+=($!)
if served expert; then
  cat >"${tmp}/cluster.textproto" <<CLUSTER
model { num_layers: 1 d_model: 16 d_ff: 16 num_experts: 2 num_groups: 1 top_k: 1 seed: 1 }
groups { address: "127.0.0.1:${grpc_port}" }
router { address: "127.0.0.1:0" metrics_port: 0 }
CLUSTER
  LD_PRELOAD="${big}" "${router}" --cluster="${tmp}/cluster.textproto" --address=127.0.0.1:0 \
    --threads=1 --metrics_address=127.0.0.1 --port_file="${tmp}/router.port" \
    >"${tmp}/router.log" 2>&1 &
  pids+=($!)
  served router
fi

# The trainer exits non-zero when its endpoint cannot start.
printf 'The fortune says: a small corpus for one step.\n%.0s' $(seq 20) >"${tmp}/corpus.txt"
LD_PRELOAD="${big}" "${trainer}" --experts=inprocess --n_layer=1 --n_head=2 --d_model=16 \
  --d_ff=16 --num_experts=2 --num_groups=1 --block_size=8 --batch_size=2 --steps=1 \
  --eval_every=1 --eval_windows=1 --threads=1 --data="${tmp}/corpus.txt" \
  --out_dir="${tmp}/run" --metrics_port=0 --metrics_address=127.0.0.1 >"${tmp}/trainer.log" 2>&1 ||
  fail "himoe-trainer --metrics_port=0: $(tail -1 "${tmp}/trainer.log")"

if ((failures > 0)); then
  echo "${failures} check(s) failed"
  exit 1
fi
echo "metrics beside big TLS: every check passed"
