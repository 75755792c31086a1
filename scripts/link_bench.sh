#!/usr/bin/env bash
# Training across network links at their speed. Network namespaces on this
# machine stand in for 5 hosts (scripts/netns_hosts.sh): 4 run one
# himoe-expert each, the coordinator runs himoe-trainer --experts=cluster.
# The coordinator's link (both directions) is shaped with tc's token bucket
# to each --rates entry ("none": the unshaped veth). Every run is a step of
# 2048 tokens, a batch of 16 sequences of 128 split into --micro_batches
# (--split_batch; 2, the trainer's default with remote experts), with overlap
# "on" (all in flight at once, --micro_batches_in_flight: one's dense work
# while another's rows are on the wire) or "off" (one at a time): the same
# arithmetic, so only the schedule differs. "onN": N micro-batches, all in
# flight (--split_batch N --micro_batches_in_flight N).
#
# Configs: "released" (the released code's: 4 layers, d 128, 8 experts in 4
# groups, k 1, width 512) and "two_per_group" (16 experts in 4 groups, k 2,
# width 256: the same expert FLOPs a token, each token to 2 experts of every
# group). Wire dtypes float32 and bfloat16. Each round runs every rate, dtype
# and overlap once, the rounds one after the other, so a VM's drift falls on
# all of them.
#
# Per run: tokens/s (median step after 5), the rows, outputs and gradients
# the transport moved a step (himoe-trainer's row bytes), the link's bound
# (tokens/s if moving those bytes at the tbf rate were the only cost: the
# larger direction), and the bytes through the coordinator's eth0. Every run
# checks the bytes against tokens x distinct groups a token x d_model x
# bytes a value x 2 (Forward and Backward), each way, and fails otherwise.
#
# Then latency: the links unshaped and a delay relay (scripts/delay_relay.py)
# in the coordinator's namespace in front of every group, at each --rtts
# round-trip time (ms; the relay adds it on top of the veth's): training on
# the released config, float32, overlap on and off, and one Generate stream's
# time a token through himoe-router serving a checkpoint of that config
# (scripts/generate_latency.py).
#
# Needs root and iproute2; exits 77 without them. Writes a Markdown table
# (--out, default runs/bench/link.md).
#
#   scripts/link_bench.sh [--rates "500mbit 1gbit 10gbit none"] [--configs "released two_per_group"]
#       [--dtypes "float32 bfloat16"] [--overlap "on off on4"] [--rtts "0.2 1 5"]
#       [--micro_batches 2] [--steps 30] [--rounds 2] [--out F]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${HIMOE_BUILD_DIR:-${ROOT}/build}"
rates="500mbit 1gbit 10gbit none"
configs="released two_per_group"
dtypes="float32 bfloat16"
overlaps="on off on4"
rtts="0.2 1 5"
micro_batches=2
steps=30
rounds=2
out="${ROOT}/runs/bench/link.md"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rates) rates="$2"; shift 2 ;;
    --configs) configs="$2"; shift 2 ;;
    --dtypes) dtypes="$2"; shift 2 ;;
    --overlap) overlaps="$2"; shift 2 ;;
    --rtts) rtts="$2"; shift 2 ;;
    --micro_batches) micro_batches="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) sed -n '2,36p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
# shellcheck source=scripts/netns_hosts.sh
source "${ROOT}/scripts/netns_hosts.sh"
readonly kGroups=4 kPort=50071 kRelayPort=51071
netns_bench_up link_bench "himoelink$$" 10.214.0 "${kGroups}"
work="${NETNS_WORK}"

# config_model NAME: "num_experts top_k d_ff" of a config.
config_model() {
  case "$1" in
    released) echo "8 1 512" ;;
    two_per_group) echo "16 2 256" ;;
    *) echo "link_bench: unknown config '$1'" >&2; exit 2 ;;
  esac
}

# experts_up CONFIG: (re)starts the 4 groups with the config's experts.
experts_up() {
  read -r experts top_k d_ff < <(config_model "$1")
  netns_hosts_stop "${work}"
  netns_experts_up "${BUILD}/expert_service/himoe-expert" "${work}" "${kPort}" \
    --num_groups=${kGroups} --num_experts="${experts}" --num_layers=4 --d_model=128 \
    --d_ff="${d_ff}" --seed=1 --threads=1 --metrics_port=-1 --insecure_training ||
    { echo "link_bench: ${NETNS_ERROR}" >&2; exit 1; }
}

# cluster_file CONFIG ADDRESS_OF_GROUP...: the trainer's cluster file.
cluster_file() {
  local config="$1" g
  shift
  read -r experts top_k d_ff < <(config_model "${config}")
  echo "model { num_layers: 4 d_model: 128 d_ff: ${d_ff} num_experts: ${experts} num_groups: ${kGroups} top_k: ${top_k} seed: 1 }"
  echo 'routing { method: "himoe" }'
  for g in "$@"; do echo "groups { address: \"${g}\" }"; done
}

eth0_bytes() {
  local d=/sys/class/net/eth0/statistics
  ip netns exec "${NETNS_COORD}" sh -c "echo \$(cat ${d}/tx_bytes) \$(cat ${d}/rx_bytes)"
}

results="${work}/results.tsv"
# train NAME CLUSTER_FILE CONFIG DTYPE OVERLAP RATE RTT ROUND [FLAG...]: one run, one
# results line.
train() {
  local name="$1" cluster="$2" config="$3" wire="$4" overlap="$5" rate="$6" rtt="$7" round="$8"
  local split="${micro_batches}" in_flight tx0 rx0 tx1 rx1
  case "${overlap}" in
    off) in_flight=1 ;;
    on) in_flight="${split}" ;;
    on*) split="${overlap#on}" in_flight="${overlap#on}" ;;
    *) echo "link_bench: unknown overlap '${overlap}'" >&2; exit 2 ;;
  esac
  read -r _ _ d_ff < <(config_model "${config}")
  echo "link_bench: ${name}" >&2
  read -r tx0 rx0 < <(eth0_bytes)
  ip netns exec "${NETNS_COORD}" "${BUILD}/trainer/himoe-trainer" --experts=cluster \
    --cluster "${cluster}" --wire_dtype="${wire}" --threads 1 \
    --n_layer 4 --d_model 128 --n_head 4 --block_size 128 --batch_size 16 \
    --split_batch "${split}" --micro_batches_in_flight "${in_flight}" \
    --d_ff "${d_ff}" --dense_ff 512 \
    --lr 1e-3 --steps "${steps}" --warmup 5 --eval_every 1000000 --eval_windows 1 \
    --log_every 1000000 --metrics_port=-1 --out_dir "${work}/${name}" "${@:9}" \
    >"${work}/${name}.log" 2>&1 ||
    { tail -n 20 "${work}/${name}.log"; echo "link_bench: ${name} failed" >&2; exit 1; }
  read -r tx1 rx1 < <(eth0_bytes)
  echo -e "${config}\t${overlap}\t${rate}\t${wire}\t${rtt}\t${round}\t$((tx1 - tx0))\t$((rx1 - rx0))\t${work}/${name}/metrics.jsonl" >>"${results}"
}

direct=()
for ((g = 0; g < kGroups; ++g)); do direct+=("$(netns_host_ip "${g}"):${kPort}"); done
for config in ${configs}; do
  experts_up "${config}"
  cluster_file "${config}" "${direct[@]}" >"${work}/${config}.textproto"
  for ((round = 1; round <= rounds; ++round)); do
    for rate in ${rates}; do
      netns_shape_coord "${rate}"
      for wire in ${dtypes}; do
        for overlap in ${overlaps}; do
          train "${config}-${rate}-${wire}-${overlap}-r${round}" "${work}/${config}.textproto" \
            "${config}" "${wire}" "${overlap}" "${rate}" - "${round}"
        done
      done
    done
  done
done

if [[ -n "${rtts}" ]]; then
  netns_shape_coord none
  experts_up released
  cluster_file released "${direct[@]}" >"${work}/served.textproto"
  # The model a router serves for the Generate streams: a few steps' checkpoint.
  ip netns exec "${NETNS_COORD}" "${BUILD}/trainer/himoe-trainer" --experts=cluster \
    --cluster "${work}/served.textproto" --threads 1 --n_layer 4 --d_model 128 --n_head 4 \
    --block_size 128 --batch_size 16 --d_ff 512 --dense_ff 512 --steps 5 --checkpoint_every 5 \
    --eval_every 1000000 --eval_windows 1 --log_every 1000000 --metrics_port=-1 \
    --out_dir "${work}/served" >"${work}/served.log" 2>&1 ||
    { tail -n 20 "${work}/served.log"; echo "link_bench: the served model's training failed" >&2; exit 1; }
  relayed=()
  maps=()
  for ((g = 0; g < kGroups; ++g)); do
    relayed+=("127.0.0.1:$((kRelayPort + g))")
    maps+=(--map "127.0.0.1:$((kRelayPort + g))=$(netns_host_ip "${g}"):${kPort}")
  done
  cluster_file released "${relayed[@]}" >"${work}/relayed.textproto"
  for ((round = 1; round <= rounds; ++round)); do
    for rtt in ${rtts}; do
      rm -f "${work}/relay.ready" "${work}/router.port"
      ip netns exec "${NETNS_COORD}" /usr/bin/python3 "${ROOT}/scripts/delay_relay.py" \
        --delay_ms "$(awk -v r="${rtt}" 'BEGIN { print r / 2 }')" "${maps[@]}" \
        --ready_file "${work}/relay.ready" 2>"${work}/relay.log" &
      relay=$!
      for ((t = 0; t < 100; ++t)); do
        [[ -s "${work}/relay.ready" ]] && break
        sleep 0.1
      done
      [[ -s "${work}/relay.ready" ]] || { cat "${work}/relay.log" >&2; exit 1; }
      for overlap in ${overlaps}; do
        train "rtt${rtt}-${overlap}-r${round}" "${work}/relayed.textproto" released float32 \
          "${overlap}" none "${rtt}" "${round}" --take_over_served_experts
      done
      # One Generate stream through a router in front of the relay.
      ip netns exec "${NETNS_COORD}" "${BUILD}/router_service/himoe-router" \
        --cluster "${work}/relayed.textproto" --address 127.0.0.1:0 --threads 1 \
        --metrics_port=-1 --checkpoint "${work}/served/checkpoints" \
        --port_file "${work}/router.port" >"${work}/router-${rtt}-r${round}.log" 2>&1 &
      router=$!
      for ((t = 0; t < 300; ++t)); do
        [[ -s "${work}/router.port" ]] && break
        sleep 0.1
      done
      [[ -s "${work}/router.port" ]] ||
        { tail -n 20 "${work}/router-${rtt}-r${round}.log" >&2; exit 1; }
      ms="$(ip netns exec "${NETNS_COORD}" /usr/bin/python3 "${ROOT}/scripts/generate_latency.py" \
        --address "127.0.0.1:$(head -n 1 "${work}/router.port")")"
      echo -e "${rtt}\t${round}\t${ms}" >>"${work}/generate.tsv"
      kill "${router}" "${relay}" 2>/dev/null || true
      wait "${router}" "${relay}" 2>/dev/null || true
    done
  done
fi

mkdir -p "$(dirname "${out}")"
/usr/bin/python3 "${ROOT}/scripts/link_report.py" "${results}" "${out}" "${steps}" "${micro_batches}" \
  "${work}/generate.tsv"
