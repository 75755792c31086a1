#!/usr/bin/env bash
# Grouped against flat dispatch, and the coordinator's cost per group, with
# the expert groups on hosts in network namespaces (scripts/netns_hosts.sh),
# each one himoe-expert.
#
# Methods: himoe and moge (grouped: k of every group's experts for every
# token, so every group gets the same rows) against vanilla (flat top-K over
# all N: a group gets what its experts won) on the released config (4 layers,
# d 128, 8 experts in 4 groups, K 4, width 512), the coordinator's link
# shaped to each --rates entry; himoe-trainer's run log gives, a step, the
# Forward calls' wait for their slowest group and that minus the mean of the
# groups' (the straggler's share).
#
# Scaling: M = each --groups entry hosts, N = 2M experts, k 1 per group, a
# small model (2 layers, d 64, width 128, a batch of 16 x 64, split in two),
# unshaped links: tokens/s and the coordinator's CPU a step (user + system,
# /proc, over the timed steps).
#
# Each round runs everything once. Needs root and iproute2; exits 77 without
# them. Writes a Markdown table (--out, default runs/bench/groups.md).
#
#   scripts/groups_bench.sh [--rates "1gbit none"] [--methods "himoe moge vanilla"]
#       [--groups "2 4 8 16"] [--steps 30] [--rounds 2] [--out F]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${HIMOE_BUILD_DIR:-${ROOT}/build}"
rates="1gbit none"
methods="himoe moge vanilla"
scale="2 4 8 16"
steps=30
rounds=2
out="${ROOT}/runs/bench/groups.md"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rates) rates="$2"; shift 2 ;;
    --methods) methods="$2"; shift 2 ;;
    --groups) scale="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
# shellcheck source=scripts/netns_hosts.sh
source "${ROOT}/scripts/netns_hosts.sh"
readonly kPort=50071
most=4
for m in ${scale}; do ((m > most)) && most=${m}; done
netns_bench_up groups_bench "himoegrp$$" 10.215.0 "${most}"
work="${NETNS_WORK}"
all_hosts=("${NETNS_HOSTS[@]}")

# experts_up M FLAG...: himoe-expert on the first M hosts (the others stopped).
experts_up() {
  local m="$1"
  shift
  NETNS_HOSTS=("${all_hosts[@]}")
  netns_hosts_stop "${work}"
  NETNS_HOSTS=("${all_hosts[@]:0:m}")
  netns_experts_up "${BUILD}/expert_service/himoe-expert" "${work}" "${kPort}" \
    --num_groups="${m}" --seed=1 --threads=1 --metrics_port=-1 --insecure_training "$@" ||
    { echo "groups_bench: ${NETNS_ERROR}" >&2; exit 1; }
}

# cluster_file M "MODEL FIELDS" METHOD: the trainer's cluster file.
cluster_file() {
  local g
  echo "model { $2 num_groups: $1 seed: 1 }"
  echo "routing { method: \"$3\" }"
  for ((g = 0; g < $1; ++g)); do echo "groups { address: \"$(netns_host_ip "${g}"):${kPort}\" }"; done
}

# train NAME CLUSTER FLAG...: one himoe-trainer run in the coordinator's namespace.
train() {
  local name="$1" cluster="$2"
  shift 2
  echo "groups_bench: ${name}" >&2
  ip netns exec "${NETNS_COORD}" "${BUILD}/trainer/himoe-trainer" --experts=cluster \
    --cluster "${cluster}" --threads 1 --steps "${steps}" --warmup 5 --lr 1e-3 \
    --eval_every 1000000 --eval_windows 1 --log_every 1000000 --metrics_port=-1 \
    --out_dir "${work}/${name}" "$@" >"${work}/${name}.log" 2>&1 ||
    { tail -n 20 "${work}/${name}.log"; echo "groups_bench: ${name} failed" >&2; exit 1; }
}

released=(--n_layer 4 --d_model 128 --n_head 4 --block_size 128 --batch_size 16 --d_ff 512
          --dense_ff 512)
if [[ -n "${methods}" ]]; then
  experts_up 4 --num_experts=8 --num_layers=4 --d_model=128 --d_ff=512
  for ((round = 1; round <= rounds; ++round)); do
    for rate in ${rates}; do
      netns_shape_coord "${rate}"
      for method in ${methods}; do
        cluster_file 4 "num_layers: 4 d_model: 128 d_ff: 512 num_experts: 8 top_k: 1" \
          "${method}" >"${work}/${method}.textproto"
        train "${method}-${rate}-r${round}" "${work}/${method}.textproto" "${released[@]}"
        echo -e "method\t${method}\t${rate}\t${round}\t${work}/${method}-${rate}-r${round}/metrics.jsonl" \
          >>"${work}/results.tsv"
      done
    done
  done
  netns_shape_coord none
fi

small=(--n_layer 2 --d_model 64 --n_head 2 --block_size 64 --batch_size 16 --d_ff 128
       --dense_ff 256)
for m in ${scale}; do
  experts_up "${m}" --num_experts=$((2 * m)) --num_layers=2 --d_model=64 --d_ff=128
  cluster_file "${m}" "num_layers: 2 d_model: 64 d_ff: 128 num_experts: $((2 * m)) top_k: 1" \
    himoe >"${work}/m${m}.textproto"
  for ((round = 1; round <= rounds; ++round)); do
    train "m${m}-r${round}" "${work}/m${m}.textproto" "${small[@]}"
    echo -e "scale\t${m}\tnone\t${round}\t${work}/m${m}-r${round}/metrics.jsonl" >>"${work}/results.tsv"
  done
done

mkdir -p "$(dirname "${out}")"
/usr/bin/python3 "${ROOT}/scripts/groups_report.py" "${work}/results.tsv" "${out}" "${steps}"
