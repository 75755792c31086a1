#!/usr/bin/env bash
# Multi-host training on one machine: network namespaces joined by a bridge
# stand in for machines. Four "hosts" run one himoe-expert each on their own
# IP, a fifth runs the coordinator (himoe-trainer --experts=cluster). The
# losses must equal an in-process run of the same seed, and each expert
# host's interface must have carried the traffic.
#
# The cluster runs as deployed across hosts: mutual TLS with roles
# (deploy/make_certs.sh's certificates, the hosts' IPs as SANs). A trainer
# presenting the router's certificate is refused PERMISSION_DENIED before
# any group begins its run.
#
#   multihost_netns_test.sh HIMOE_EXPERT HIMOE_TRAINER
#
# Exit 77 (ctest SKIP_RETURN_CODE) with the reason when namespaces cannot be
# made (not root, no iproute2, no CAP_SYS_ADMIN). Nothing is created in the
# root namespace except the namespaces themselves, and everything (processes,
# namespaces, files) is removed on every exit path.
set -euo pipefail

expert_bin="$1"
trainer_bin="$2"
readonly kSkip=77
readonly kGroups=4
readonly kSubnet=10.213.0
readonly kPort=50061

skip() {
  echo "SKIP: $*"
  exit "${kSkip}"
}

[[ ${EUID} -eq 0 ]] || skip "network namespaces need root (running as uid ${EUID})"
command -v ip >/dev/null || skip "iproute2's ip is not installed"

# shellcheck source=scripts/netns_hosts.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/scripts/netns_hosts.sh"
work="$(mktemp -d)"
cleanup() {
  netns_hosts_down
  rm -rf "${work}"
}
trap cleanup EXIT

netns_switch_up "himoe$$" "${kSubnet}" || skip "${NETNS_ERROR}"
netns_hosts_add "${kGroups}"
coord="${NETNS_COORD}"
hosts=("${NETNS_HOSTS[@]}")
coord_ip="${NETNS_COORD_IP}"
host_ip() { netns_host_ip "$1"; }

# Model: 2 MoE layers, d_model 32, N=8 experts in M=4 groups, seed 1.
model_flags=(--num_groups=${kGroups} --num_experts=8 --num_layers=2 --d_model=32 --d_ff=64
  --seed=1)
host_ips=()
for ((g = 0; g < kGroups; ++g)); do host_ips+=("$(host_ip "${g}")"); done
bash "$(dirname "${BASH_SOURCE[0]}")/../../deploy/make_certs.sh" "${work}/certs" "${host_ips[@]}" \
  >/dev/null
tls_flags=(--tls_ca="${work}/certs/ca.pem" --tls_cert="${work}/certs/expert.pem"
  --tls_key="${work}/certs/expert.key" --trainer_identity=spiffe://himoe/trainer
  --router_identity=spiffe://himoe/router)
netns_experts_up "${expert_bin}" "${work}" "${kPort}" "${model_flags[@]}" --threads=1 \
  "${tls_flags[@]}" ||
  { echo "FAIL: ${NETNS_ERROR}" >&2; exit 1; }
echo "experts serving on $(for ((g = 0; g < kGroups; ++g)); do echo -n "$(host_ip "${g}"):${kPort} "; done)"

# The hosts are separate: the coordinator reaches each expert host's IP, not
# a service on its own loopback, and the root namespace reaches none of them.
tcp_open() { ip netns exec "$1" timeout 3 bash -c "exec 3<>/dev/tcp/$2/$3" 2>/dev/null; }
for ((g = 0; g < kGroups; ++g)); do
  tcp_open "${coord}" "$(host_ip "${g}")" ${kPort} ||
    { echo "FAIL: ${coord_ip} cannot reach $(host_ip "${g}"):${kPort}" >&2; exit 1; }
done
if tcp_open "${coord}" 127.0.0.1 ${kPort}; then
  echo "FAIL: an expert answers on the coordinator's own loopback" >&2
  exit 1
fi
if timeout 3 bash -c "exec 3<>/dev/tcp/$(host_ip 0)/${kPort}" 2>/dev/null; then
  echo "FAIL: the root namespace reaches the expert host $(host_ip 0)" >&2
  exit 1
fi

rx_bytes() { ip netns exec "$1" cat /sys/class/net/eth0/statistics/rx_bytes; }
rx_before=()
for ((g = 0; g < kGroups; ++g)); do rx_before+=("$(rx_bytes "${hosts[g]}")"); done

# cluster_file TRAINER_CERT: the cluster, with the trainer presenting TRAINER_CERT.
cluster_file() {
  echo "model { num_layers: 2 d_model: 32 d_ff: 64 num_experts: 8 num_groups: ${kGroups} top_k: 1 seed: 1 }"
  echo 'routing { method: "himoe" }'
  for ((g = 0; g < kGroups; ++g)); do echo "groups { address: \"$(host_ip "${g}"):${kPort}\" }"; done
  echo "tls { ca: \"certs/ca.pem\" cert: \"certs/expert.pem\" key: \"certs/expert.key\""
  echo "  trainer { cert: \"certs/$1.pem\" key: \"certs/$1.key\" identity: \"spiffe://himoe/trainer\" }"
  echo "  router { cert: \"certs/router.pem\" key: \"certs/router.key\" identity: \"spiffe://himoe/router\" } }"
}
cluster_file trainer >"${work}/cluster.textproto"
cluster_file router >"${work}/impostor.textproto"

# A small deterministic corpus.
for ((line = 0; line < 600; ++line)); do
  echo "line ${line}: grouped experts route $((line * 7919 % 1000)) tokens over the network."
done >"${work}/corpus.txt"
# --split_batch 2 in both runs: the cluster's default, made in process too.
common=(--data "${work}/corpus.txt" --n_layer 2 --n_head 2 --block_size 32 --batch_size 8
  --split_batch 2 --steps 6 --eval_every 3 --eval_windows 8 --warmup 2 --seed 1 --threads 1 --log_every 1)
if ip netns exec "${coord}" "${trainer_bin}" --experts=cluster \
  --cluster "${work}/impostor.textproto" "${common[@]}" --out_dir "${work}/impostor" \
  >"${work}/impostor.log" 2>&1; then
  echo "FAIL: a trainer with the router's certificate trained" >&2
  exit 1
fi
grep -q "PERMISSION_DENIED.*BeginRun.*spiffe://himoe/router" "${work}/impostor.log" ||
  { cat "${work}/impostor.log"; echo "FAIL: the impostor was not refused by the roles" >&2; exit 1; }
ip netns exec "${coord}" "${trainer_bin}" --experts=cluster --cluster "${work}/cluster.textproto" \
  "${common[@]}" --out_dir "${work}/multihost" >"${work}/multihost.log" 2>&1 ||
  { cat "${work}/multihost.log"; echo "FAIL: training across the hosts failed" >&2; exit 1; }
"${trainer_bin}" --experts=inprocess --d_model 32 --d_ff 64 "${common[@]}" \
  --out_dir "${work}/inprocess" >"${work}/inprocess.log" 2>&1 ||
  { cat "${work}/inprocess.log"; echo "FAIL: the in-process run failed" >&2; exit 1; }
tail -n 3 "${work}/multihost.log"

rx_after=()
for ((g = 0; g < kGroups; ++g)); do rx_after+=("$(rx_bytes "${hosts[g]}")"); done

# Same losses step by step (and the same validation), to fp tolerance; every
# expert host received at least the hidden rows of one micro-batch's forward:
# 8 sequences x 32 tokens x 32 floats x 4 bytes / 4 groups, k=1, per layer.
/usr/bin/python3 - "${work}/multihost/metrics.jsonl" "${work}/inprocess/metrics.jsonl" \
  "${rx_before[*]}" "${rx_after[*]}" <<'EOF'
import json, math, sys

def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

remote, local = read(sys.argv[1]), read(sys.argv[2])
train = lambda rows: [r for r in rows if r.get("kind") == "train"]
evals = lambda rows: [r for r in rows if r.get("kind") == "eval"]
fail = []
if len(train(remote)) != 6 or len(train(local)) != 6:
    fail.append(f"expected 6 steps, got {len(train(remote))} and {len(train(local))}")
for a, b in zip(train(remote), train(local)):
    for key in ("loss", "task"):
        if not (math.isfinite(a[key]) and abs(a[key] - b[key]) <= 1e-4):
            fail.append(f"step {a['step']} {key}: across hosts {a[key]}, in-process {b[key]}")
    print(f"step {a['step']}: loss {a['loss']:.6f} across hosts, {b['loss']:.6f} in-process")
for a, b in zip(evals(remote), evals(local)):
    if abs(a["val_loss"] - b["val_loss"]) > 1e-4:
        fail.append(f"eval at step {a['step']}: {a['val_loss']} vs {b['val_loss']}")
if len(evals(remote)) != 3:
    fail.append(f"expected 3 evaluations, got {len(evals(remote))}")
before = [int(x) for x in sys.argv[3].split()]
after = [int(x) for x in sys.argv[4].split()]
floor = 8 * 32 * 32 * 4 // 4
for g, (x, y) in enumerate(zip(before, after)):
    print(f"expert host {g}: {y - x} bytes received on eth0")
    if y - x < floor:
        fail.append(f"expert host {g} received {y - x} bytes, fewer than one forward's {floor}")
if fail:
    print("FAIL:\n  " + "\n  ".join(fail), file=sys.stderr)
    sys.exit(1)
print("multi-host training equals in-process training")
EOF
