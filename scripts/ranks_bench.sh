#!/usr/bin/env bash
# Data-parallel trainer ranks against the same expert groups, on hosts in
# network namespaces (scripts/netns_hosts.sh): 4 hosts run one himoe-expert
# each (the released config: 4 layers, d 128, 8 experts in 4 groups, k 1,
# width 512), the coordinator's namespace runs rank 0, a fifth host rank 1.
# Every step is 2048 tokens: 1 rank of 16 sequences of 128, or 2 ranks of 8
# each (the same step, docs/formulas.md). The links of both rank hosts are
# shaped with tc's token bucket to each --rates entry ("none": unshaped).
#
# Per run: tokens/s (median step after 5); each rank's gradient all-reduce a
# step (himoe-trainer's run log: the wait for the other rank and the transfer,
# after the backward) and its bytes; the CPU a step of every process (the
# ranks' from their run logs over the timed steps, the expert processes' from
# /proc over the run). The CPU-bound limit is 2 cores' worth of the 1-rank
# step's CPU: 2048 tokens x cores / (its core-seconds a step), measured in the
# same round.
#
# Needs root and iproute2; exits 77 without them. Writes a Markdown table
# (--out, default runs/bench/ranks.md).
#
#   scripts/ranks_bench.sh [--rates "10gbit 1gbit none"] [--steps 30] [--rounds 2] [--out F]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${HIMOE_BUILD_DIR:-${ROOT}/build}"
rates="10gbit 1gbit none"
steps=30
rounds=2
out="${ROOT}/runs/bench/ranks.md"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rates) rates="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
# shellcheck source=scripts/netns_hosts.sh
source "${ROOT}/scripts/netns_hosts.sh"
readonly kPort=50081 kStorePort=29511
netns_bench_up ranks_bench "himoerk$$" 10.216.0 5
work="${NETNS_WORK}"
all_hosts=("${NETNS_HOSTS[@]}")
rank1_ns="${all_hosts[4]}"
expert_hosts=("${all_hosts[@]:0:4}")
NETNS_HOSTS=("${expert_hosts[@]}")
netns_experts_up "${BUILD}/expert_service/himoe-expert" "${work}" "${kPort}" \
  --num_groups=4 --seed=1 --threads=1 --metrics_port=-1 --insecure_training \
  --num_experts=8 --num_layers=4 --d_model=128 --d_ff=512 ||
  { echo "ranks_bench: ${NETNS_ERROR}" >&2; exit 1; }
NETNS_HOSTS=("${all_hosts[@]}")
{
  echo "model { num_layers: 4 d_model: 128 d_ff: 512 num_experts: 8 top_k: 1 num_groups: 4 seed: 1 }"
  echo 'routing { method: "himoe" }'
  for g in 0 1 2 3; do echo "groups { address: \"$(netns_host_ip "${g}"):${kPort}\" }"; done
} >"${work}/cluster.textproto"

# The user + system seconds of every process in the expert hosts so far.
expert_cpu_seconds() {
  local ns pid total=0 ticks
  ticks="$(getconf CLK_TCK)"
  for ns in "${expert_hosts[@]}"; do
    for pid in $(ip netns pids "${ns}"); do
      total=$((total + $(awk '{print $14 + $15}' "/proc/${pid}/stat" 2>/dev/null || echo 0)))
    done
  done
  awk -v t="${total}" -v k="${ticks}" 'BEGIN { printf "%.3f", t / k }'
}

flags=(--experts=cluster --cluster "${work}/cluster.textproto" --n_layer 4 --d_model 128
       --n_head 4 --block_size 128 --d_ff 512 --dense_ff 512 --threads 1 --steps "${steps}"
       --warmup 5 --lr 1e-3 --eval_every 1000000 --eval_windows 1 --log_every 1000000
       --metrics_port=-1 --gemm_gflops=-1 --dist_timeout_s 120)

# run NAME RANKS: one run; appends its results line.
run() {
  local name="$1" ranks="$2" before after status=0
  echo "ranks_bench: ${name}" >&2
  before="$(expert_cpu_seconds)"
  if [[ "${ranks}" -eq 1 ]]; then
    ip netns exec "${NETNS_COORD}" "${BUILD}/trainer/himoe-trainer" "${flags[@]}" \
      --batch_size 16 --out_dir "${work}/${name}" >"${work}/${name}.log" 2>&1 || status=$?
  else
    local common=(--batch_size 8 --split_batch 1 --world_size 2 --master_addr "${NETNS_COORD_IP}"
                  --master_port "${kStorePort}" --out_dir "${work}/${name}")
    ip netns exec "${NETNS_COORD}" env GLOO_SOCKET_IFNAME=eth0 \
      "${BUILD}/trainer/himoe-trainer" "${flags[@]}" "${common[@]}" --rank 0 \
      >"${work}/${name}.log" 2>&1 &
    local rank0=$!
    ip netns exec "${rank1_ns}" env GLOO_SOCKET_IFNAME=eth0 \
      "${BUILD}/trainer/himoe-trainer" "${flags[@]}" "${common[@]}" --rank 1 \
      >"${work}/${name}.rank1.log" 2>&1 || status=$?
    wait "${rank0}" || status=$?
  fi
  if [[ "${status}" -ne 0 ]]; then
    tail -n 20 "${work}/${name}"*.log >&2
    echo "ranks_bench: ${name} failed" >&2
    exit 1
  fi
  after="$(expert_cpu_seconds)"
  echo -e "${ranks}\t${rate}\t${round}\t$(awk -v a="${after}" -v b="${before}" 'BEGIN { print a - b }')\t${work}/${name}" \
    >>"${work}/results.tsv"
}

for ((round = 1; round <= rounds; ++round)); do
  for rate in ${rates}; do
    netns_shape_coord "${rate}"
    netns_shape_host 4 "${rate}"
    run "one-${rate}-r${round}" 1
    run "two-${rate}-r${round}" 2
  done
done
netns_shape_coord none
netns_shape_host 4 none

mkdir -p "$(dirname "${out}")"
/usr/bin/python3 "${ROOT}/scripts/ranks_report.py" "${work}/results.tsv" "${out}" "${steps}"
