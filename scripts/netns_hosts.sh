# Sourced: "hosts" on one machine, as network namespaces joined by a bridge.
#
#   netns_switch_up ID SUBNET   the switch namespace (bridge br0); returns
#                               non-zero, with the reason in NETNS_ERROR, when
#                               a namespace cannot be made (not root, no
#                               CAP_SYS_ADMIN)
#   netns_hosts_add N           then a coordinator namespace and N host
#                               namespaces, each with an eth0 on SUBNET.0/24
#                               (coordinator .10, host g .11+g) plugged into
#                               the switch's port<i> (port0 the coordinator's);
#                               call it outside `if` and `||`, so that set -e
#                               stops on a failure
#   netns_experts_up BIN DIR PORT FLAG...   a himoe-expert on every host
#   netns_hosts_stop DIR        stops what runs on the hosts of NETNS_HOSTS
#                               and removes their port files from DIR
#   netns_shape_coord RATE      the coordinator's link shaped both ways with
#                               tc's token bucket ("none": unshaped)
#   netns_shape_host G RATE     the same for host g's link
#   netns_hosts_down            kills what runs in them and deletes them all
#
#   netns_bench_up NAME ID SUBNET N   all of the above for a bench script
#
# Sets NETNS_SWITCH, NETNS_COORD, NETNS_HOSTS (array), NETNS_COORD_IP and
# netns_host_ip G. Nothing is created in the root namespace except the
# namespaces themselves.

NETNS_CREATED=()

# netns_bench_up NAME ID SUBNET HOSTS: a bench's testbed, or exit 77 (skip)
# naming why: root and tc are needed, and the namespaces must be made. Makes
# NETNS_WORK (a temporary folder) and removes it, and the namespaces, at exit.
netns_bench_up() {
  [[ ${EUID} -eq 0 ]] || { echo "SKIP: $1: network namespaces need root" >&2; exit 77; }
  command -v tc >/dev/null || { echo "SKIP: $1: iproute2's tc is not installed" >&2; exit 77; }
  NETNS_WORK="$(mktemp -d)"
  trap 'netns_hosts_down; rm -rf "${NETNS_WORK}"' EXIT
  netns_switch_up "$2" "$3" || { echo "SKIP: $1: ${NETNS_ERROR}" >&2; exit 77; }
  netns_hosts_add "$4"
}

netns_switch_up() {
  local err
  NETNS_ID="$1"
  NETNS_SUBNET="$2"
  NETNS_SWITCH="${NETNS_ID}-sw"
  if ! err="$(ip netns add "${NETNS_SWITCH}" 2>&1)"; then
    NETNS_ERROR="cannot create a network namespace: ${err}"
    return 1
  fi
  NETNS_CREATED+=("${NETNS_SWITCH}")
}

netns_hosts_add() {
  local n="$1" ns i
  NETNS_COORD="${NETNS_ID}-coord"
  NETNS_HOSTS=()
  for ((i = 0; i < n; ++i)); do NETNS_HOSTS+=("${NETNS_ID}-h${i}"); done
  ip -n "${NETNS_SWITCH}" link set lo up
  ip -n "${NETNS_SWITCH}" link add br0 type bridge
  ip -n "${NETNS_SWITCH}" link set br0 up
  i=0
  for ns in "${NETNS_COORD}" "${NETNS_HOSTS[@]}"; do
    ip netns add "${ns}"
    NETNS_CREATED+=("${ns}")
    ip -n "${ns}" link set lo up
    # Created in the switch with its peer moved straight into the host as eth0.
    ip -n "${NETNS_SWITCH}" link add "port${i}" type veth peer name eth0 netns "${ns}"
    ip -n "${NETNS_SWITCH}" link set "port${i}" master br0 up
    ip -n "${ns}" addr add "${NETNS_SUBNET}.$((10 + i))/24" dev eth0
    ip -n "${ns}" link set eth0 up
    i=$((i + 1))
  done
  NETNS_COORD_IP="${NETNS_SUBNET}.10"
}

netns_host_ip() { echo "${NETNS_SUBNET}.$((11 + $1))"; }

# netns_experts_up BIN DIR PORT FLAG...: BIN (himoe-expert) for group g on host
# g at its IP:PORT with FLAG..., logs and port files in DIR; waits up to 60 s
# for every port file, else prints the logs' tails and returns non-zero
# (NETNS_ERROR says how many came up).
netns_experts_up() {
  local bin="$1" dir="$2" port="$3" g t ready=0 n=${#NETNS_HOSTS[@]}
  shift 3
  for ((g = 0; g < n; ++g)); do
    ip netns exec "${NETNS_HOSTS[g]}" "${bin}" --address="$(netns_host_ip "${g}"):${port}" \
      --group_id=${g} "$@" --port_file="${dir}/expert${g}.port" >"${dir}/expert${g}.log" 2>&1 &
  done
  for ((t = 0; t < 600; ++t)); do
    ready=0
    for ((g = 0; g < n; ++g)); do [[ -s "${dir}/expert${g}.port" ]] && ready=$((ready + 1)); done
    [[ ${ready} -eq ${n} ]] && return 0
    sleep 0.1
  done
  tail -n 20 "${dir}"/expert*.log >&2
  NETNS_ERROR="only ${ready} of ${n} expert hosts came up"
  return 1
}

netns_hosts_stop() {
  local ns pids
  for ns in "${NETNS_HOSTS[@]}"; do
    pids="$(ip netns pids "${ns}" 2>/dev/null || true)"
    [[ -z "${pids}" ]] || { kill ${pids} 2>/dev/null || true; }
  done
  for ns in "${NETNS_HOSTS[@]}"; do
    while [[ -n "$(ip netns pids "${ns}" 2>/dev/null)" ]]; do sleep 0.1; done
  done
  rm -f "$1"/expert*.port
}

# netns_shape_coord RATE: tc's rate syntax (500mbit, 1gbit, ...) on the
# coordinator's eth0 out and the switch's port0 out. The bucket holds 1 ms of
# the rate (at least 64 KiB), so an idle link sends no faster than the rate.
netns_shape_coord() { netns_shape_link "${NETNS_COORD}" port0 "$1"; }

# netns_shape_host G RATE: host g's link (the switch's port g+1), as above.
netns_shape_host() { netns_shape_link "${NETNS_HOSTS[$1]}" "port$(($1 + 1))" "$2"; }

netns_shape_link() {
  local ns="$1" port="$2" rate="$3" burst
  ip netns exec "${ns}" tc qdisc del dev eth0 root 2>/dev/null || true
  ip netns exec "${NETNS_SWITCH}" tc qdisc del dev "${port}" root 2>/dev/null || true
  [[ "${rate}" == none ]] && return
  burst="$(echo "${rate}" | awk '{ n = $0 + 0; u = substr($0, length(n "") + 1);
    s = (u == "kbit") ? 1e3 : (u == "mbit") ? 1e6 : (u == "gbit") ? 1e9 : 1;
    b = n * s / 8 / 1000; printf "%d", (b < 65536) ? 65536 : b }')"
  ip netns exec "${ns}" tc qdisc add dev eth0 root tbf rate "${rate}" burst "${burst}" latency 100ms
  ip netns exec "${NETNS_SWITCH}" tc qdisc add dev "${port}" root tbf rate "${rate}" burst "${burst}" \
    latency 100ms
}

netns_hosts_down() {
  local ns pids
  for ns in "${NETNS_CREATED[@]}"; do
    pids="$(ip netns pids "${ns}" 2>/dev/null || true)"
    [[ -n "${pids}" ]] && kill ${pids} 2>/dev/null || true
  done
  sleep 0.5
  for ns in "${NETNS_CREATED[@]}"; do
    pids="$(ip netns pids "${ns}" 2>/dev/null || true)"
    [[ -n "${pids}" ]] && kill -9 ${pids} 2>/dev/null || true
    ip netns del "${ns}" 2>/dev/null || true
  done
  NETNS_CREATED=()
}
