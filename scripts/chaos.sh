#!/usr/bin/env bash
# Chaos runs on hosts in network namespaces (scripts/netns_hosts.sh): a
# coordinator host and 4 expert hosts on one switch, faults injected from a
# seeded schedule (scripts/chaos.py describes the faults and the checks).
#
#   train   a fault-free training run, then the same run under --faults faults
#           (default 32 over 300 steps); passes when the chaos run ends by
#           itself, bit-identical (sha256 of the final checkpoint) to the
#           fault-free one, with every step once in its run log
#   serve   a router serving a trained checkpoint under bounded RouteForward
#           and Generate load for --seconds (default 600), a fault every
#           --interval s (default 20); passes when every answer equals the
#           in-process reference or is a clear status naming the group, no
#           call outlives the deadline, memory stays flat and serving
#           resumes within 2 s of each return
#
# Needs root and iproute2; exits 77 without them. Prints the schedule and the
# figures; writes them as Markdown (--out, default runs/bench/chaos-<mode>.md).
#
#   scripts/chaos.sh train [--seed S] [--faults N] [--steps N] [--run_state 0|1] [--out F]
#   scripts/chaos.sh serve [--seed S] [--seconds N] [--interval N] [--out F]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${HIMOE_BUILD_DIR:-${ROOT}/build}"
mode="${1:-}"
case "${mode}" in
  train | serve) shift ;;
  *) sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
out="${ROOT}/runs/bench/chaos-${mode}.md"
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --seed | --faults | --steps | --checkpoint_every | --keepalive_ms | --group_wait_s | \
      --unhealable | --retry_failed_step | --run_state | --seconds | --interval | --deadline_ms | --new_tokens)
      args+=("$1" "$2"); shift 2 ;;
    *) sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
# shellcheck source=scripts/netns_hosts.sh
source "${ROOT}/scripts/netns_hosts.sh"
command -v ss >/dev/null || { echo "SKIP: chaos: iproute2's ss is not installed" >&2; exit 77; }
netns_bench_up "chaos ${mode}" "himoech$$" 10.217.0 4
ips=()
for ((g = 0; g < ${#NETNS_HOSTS[@]}; ++g)); do ips+=("$(netns_host_ip "${g}")"); done
status=0
/usr/bin/python3 "${ROOT}/scripts/chaos.py" "${mode}" --build "${BUILD}" --work "${NETNS_WORK}" \
  --switch "${NETNS_SWITCH}" --coord "${NETNS_COORD}" --coord_ip "${NETNS_COORD_IP}" \
  --hosts "$(IFS=,; echo "${NETNS_HOSTS[*]}")" --host_ips "$(IFS=,; echo "${ips[*]}")" \
  --out "${out}" "${args[@]}" || status=$?
if [[ ${status} -ne 0 ]]; then
  rm -rf "${out%.md}.logs"
  cp -r "${NETNS_WORK}" "${out%.md}.logs"
  echo "chaos ${mode}: logs in ${out%.md}.logs" >&2
fi
exit "${status}"
