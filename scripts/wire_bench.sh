#!/usr/bin/env bash
# The experts' traffic over a network link of a given rate, float32 against
# bfloat16 on the wire (himoe-trainer --wire_dtype). Network namespaces on
# this machine stand in for 5 hosts (scripts/netns_hosts.sh): 4 run one
# himoe-expert each, the coordinator runs himoe-trainer --experts=cluster on
# the released code's config. The coordinator's link (both directions) is
# shaped to each --rates entry with tc's token bucket ("none": unshaped
# veth); float32 and bfloat16 alternate, --rounds times. The CPUs are this
# machine's in every run, so only the wire differs. Needs root and iproute2.
# Writes runs/bench/wire.md (--out). Exits 77 when namespaces cannot be made.
#
#   scripts/wire_bench.sh [--rates "1gbit 10gbit none"] [--steps 30] [--rounds 2] [--out F]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${HIMOE_BUILD_DIR:-${ROOT}/build}"
rates="1gbit 10gbit none"
steps=30
rounds=2
out="${ROOT}/runs/bench/wire.md"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rates) rates="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
readonly kSkip=77
[[ ${EUID} -eq 0 ]] || { echo "SKIP: wire_bench: network namespaces need root" >&2; exit ${kSkip}; }
command -v tc >/dev/null || { echo "SKIP: wire_bench: iproute2's tc is not installed" >&2; exit ${kSkip}; }

# shellcheck source=scripts/netns_hosts.sh
source "${ROOT}/scripts/netns_hosts.sh"
work="$(mktemp -d)"
trap 'netns_hosts_down; rm -rf "${work}"' EXIT
readonly kGroups=4 kPort=50071
netns_switch_up "himoewire$$" 10.214.0 || { echo "SKIP: wire_bench: ${NETNS_ERROR}" >&2; exit ${kSkip}; }
netns_hosts_add "${kGroups}"

model=(--num_groups=${kGroups} --num_experts=8 --num_layers=4 --d_model=128 --d_ff=512 --seed=1)
netns_experts_up "${BUILD}/expert_service/himoe-expert" "${work}" "${kPort}" "${model[@]}" \
  --threads=1 --metrics_port=-1 --insecure_training ||
  { echo "wire_bench: ${NETNS_ERROR}" >&2; exit 1; }
{
  echo "model { num_layers: 4 d_model: 128 d_ff: 512 num_experts: 8 num_groups: ${kGroups} top_k: 1 seed: 1 }"
  echo 'routing { method: "himoe" }'
  for ((g = 0; g < kGroups; ++g)); do echo "groups { address: \"$(netns_host_ip "${g}"):${kPort}\" }"; done
} >"${work}/cluster.textproto"

# shape RATE: the coordinator's link, both ways (its eth0 out, the switch's port0 out).
shape() {
  ip netns exec "${NETNS_COORD}" tc qdisc del dev eth0 root 2>/dev/null || true
  ip netns exec "${NETNS_SWITCH}" tc qdisc del dev port0 root 2>/dev/null || true
  [[ "$1" == none ]] && return
  ip netns exec "${NETNS_COORD}" tc qdisc add dev eth0 root tbf rate "$1" burst 1mb latency 100ms
  ip netns exec "${NETNS_SWITCH}" tc qdisc add dev port0 root tbf rate "$1" burst 1mb latency 100ms
}
coord_bytes() {
  local d=/sys/class/net/eth0/statistics
  ip netns exec "${NETNS_COORD}" sh -c "echo \$(( \$(cat ${d}/rx_bytes) + \$(cat ${d}/tx_bytes) ))"
}

results="${work}/results.tsv"
for rate in ${rates}; do
  shape "${rate}"
  for ((round = 1; round <= rounds; ++round)); do
    for wire in float32 bfloat16; do
      name="${rate}-${wire}-r${round}"
      echo "wire_bench: ${name}" >&2
      before="$(coord_bytes)"
      ip netns exec "${NETNS_COORD}" "${BUILD}/trainer/himoe-trainer" --experts=cluster \
        --cluster "${work}/cluster.textproto" --wire_dtype="${wire}" --threads 1 \
        --n_layer 4 --d_model 128 --n_head 4 --block_size 128 --batch_size 16 --d_ff 512 \
        --lr 1e-3 --steps "${steps}" --warmup 5 --eval_every 1000000 --eval_windows 8 \
        --log_every 1000000 --metrics_port=-1 --out_dir "${work}/${name}" >"${work}/${name}.log" 2>&1 ||
        { tail -n 20 "${work}/${name}.log"; echo "wire_bench: ${name} failed" >&2; exit 1; }
      echo -e "${rate}\t${wire}\t${round}\t$(( $(coord_bytes) - before ))\t${work}/${name}/metrics.jsonl" >>"${results}"
    done
  done
done

mkdir -p "$(dirname "${out}")"
/usr/bin/python3 - "${results}" "${out}" "${steps}" <<'PY'
import datetime, json, os, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
steps = int(sys.argv[3])
def tokens_per_s(path):
    train = [json.loads(l) for l in open(path) if '"kind":"train"' in l]
    v = sorted(r["tokens_per_s"] for r in train[5:])  # after warm-up
    return v[len(v) // 2]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
out = [f"Measured {datetime.date.today()} on {cpu}, {os.cpu_count()} cores: 4 himoe-expert "
       "hosts and the coordinator in network namespaces of this machine, the released code's "
       f"config, {steps} steps a run; the coordinator's link shaped (tc tbf, both ways). "
       "tokens/s: the median step after 5; bytes: through the coordinator's eth0 per step "
       "(both ways, the whole run).", "",
       "| link | round | float32 tokens/s | bfloat16 tokens/s | bf16 / f32 | MiB per step, f32 | bf16 |",
       "|---|---:|---:|---:|---:|---:|---:|"]
by = {}
for rate, wire, rnd, nbytes, path in rows:
    by.setdefault((rate, rnd), {})[wire] = (tokens_per_s(path), int(nbytes) / steps / 2**20)
for (rate, rnd), v in by.items():
    f, b = v["float32"], v["bfloat16"]
    out.append(f"| {rate} | {rnd} | {f[0]:.0f} | {b[0]:.0f} | {b[0] / f[0]:.2f} | {f[1]:.1f} | {b[1]:.1f} |")
text = "\n".join(out) + "\n"
print(text)
open(sys.argv[2], "w").write(text)
PY
