#!/usr/bin/env bash
# Command-line manners of the four binaries: --help prints the usage line and
# the binary's own flags (not absl's "No flags matched"), and --address means
# host:port everywhere (an address without a port is refused, naming the flag).
#   cli_test.sh HIMOE_EXPERT HIMOE_ROUTER HIMOE_TRAINER HIMOE_CLUSTER
set -uo pipefail
expert="$1" router="$2" trainer="$3" cluster="$4"
tmp="$(mktemp -d)"
trap 'rm -rf "${tmp}"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# help BINARY FLAG...: --help lists every FLAG and says how to call it.
help() {
  local bin="$1"; shift
  local out="${tmp}/help.txt"
  "${bin}" --help >"${out}" 2>&1
  grep -q "No flags matched" "${out}" && fail "$(basename "${bin}") --help: No flags matched"
  grep -qE "$(basename "${bin}") \[?--" "${out}" || fail "$(basename "${bin}") --help: no usage line"
  for flag in "$@"; do
    grep -q -- "--${flag} (" "${out}" || fail "$(basename "${bin}") --help does not list --${flag}"
  done
}
help "${expert}" address group_id num_groups num_experts d_model seed dtype device port_file \
  trainer_identity router_identity authz_policy insecure_training
help "${router}" cluster address metrics_port checkpoint max_new_tokens reload_changed_experts
help "${trainer}" experts cluster method preset steps checkpoint_every resume wire_dtype \
  take_over_served_experts retry_failed_step
help "${cluster}" cluster bin_dir log_dir ready_timeout_s

# refused BINARY ARGS...: exits non-zero naming --address and host:port.
refused() {
  local out="${tmp}/refused.txt"
  if "$@" >"${out}" 2>&1; then
    fail "$(basename "$1") ${*:2}: accepted"
  elif ! grep -q -- "--address: '127.0.0.1' is not host:port" "${out}"; then
    fail "$(basename "$1") ${*:2}: $(tail -1 "${out}")"
  fi
}
printf 'model { d_model: 8 d_ff: 8 num_experts: 2 }\ngroups { address: "127.0.0.1:1" }\n' \
  >"${tmp}/cluster.textproto"
refused "${expert}" --address=127.0.0.1 --num_experts=2 --threads=1
refused "${router}" --cluster="${tmp}/cluster.textproto" --address=127.0.0.1 --threads=1
# ... and host:port is what they serve on (port 0 picks one).
"${expert}" --address=127.0.0.1:0 --num_experts=2 --threads=1 --port_file="${tmp}/port" \
  >"${tmp}/expert.log" 2>&1 &
pid=$!
for _ in $(seq 100); do [[ -s "${tmp}/port" ]] && break; sleep 0.1; done
[[ -s "${tmp}/port" ]] || fail "himoe-expert --address=127.0.0.1:0 wrote no port file"
grep -q "serving on 127.0.0.1:$(cut -d' ' -f1 "${tmp}/port")" "${tmp}/expert.log" ||
  fail "himoe-expert does not serve on 127.0.0.1:<port file's port>: $(tail -2 "${tmp}/expert.log")"
kill -TERM "${pid}"
wait "${pid}" || fail "himoe-expert did not exit 0 on SIGTERM"

# An authorization policy is checked at start: a bad one stops himoe-expert
# naming the field, before it serves.
printf '{"name": "p", "allow_rules": [{"name": "a", "request": {"paths": ["/himoe.v1.ExpertService/Stepp"]}}]}' \
  >"${tmp}/policy.json"
if "${expert}" --address=127.0.0.1:0 --num_experts=2 --threads=1 --authz_policy="${tmp}/policy.json" \
  >"${tmp}/policy.txt" 2>&1; then
  fail "himoe-expert --authz_policy with an unknown method: accepted"
elif ! grep -q "allow_rules\[0\].request.paths\[0\]: '/himoe.v1.ExpertService/Stepp' names no method" \
  "${tmp}/policy.txt"; then
  fail "himoe-expert --authz_policy: $(tail -1 "${tmp}/policy.txt")"
fi

# A bad --wire_dtype is refused by name, before anything starts.
if "${trainer}" --experts=inprocess --wire_dtype=fp8 --steps=1 >"${tmp}/wire.txt" 2>&1; then
  fail "himoe-trainer --wire_dtype=fp8: accepted"
elif ! grep -q -- "--wire_dtype: expected float32 or bfloat16, got 'fp8'" "${tmp}/wire.txt"; then
  fail "himoe-trainer --wire_dtype=fp8: $(tail -1 "${tmp}/wire.txt")"
fi

if ((failures > 0)); then
  echo "${failures} check(s) failed"
  exit 1
fi
echo "cli: every check passed"
