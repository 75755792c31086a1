#!/usr/bin/env bash
# Builds himoe against a CUDA LibTorch and checks the GPU path: the CUDA tests
# (they skip without CUDA, so a skip fails this check), the metrics endpoint
# beside that LibTorch (its libraries' static TLS) and a short training
# run whose expert groups live on cuda:0, compared step by step with the same
# run on CPU experts.
#
#   bash scripts/cuda_check.sh [STAGE...]     stages: build tests train (default: all three),
#                                             suite (the test suite; build with HIMOE_CHECK_TARGETS=all)
#   bash scripts/cuda_check.sh fetch-debs DIR  (on Debian bookworm) download the .debs below
#
#   HIMOE_TORCH_PREFIX  CMake prefix of the CUDA LibTorch (default: the torch
#                       of `python3`, i.e. torch.utils.cmake_prefix_path)
#   HIMOE_DEBS          folder of .debs from `fetch-debs`, for a machine that is
#                       not Debian (a CUDA image with pip's torch): they are
#                       unpacked into HIMOE_DEPS_PREFIX (/opt/himoe-deps) and
#                       only libraries the system lacks are kept
#   HIMOE_CUDA_BUILD    build folder (build-cuda)
#   OUT                 where logs and metrics go (/tmp/himoe-cuda-check)
#   HIMOE_CHECK_D_MODEL, HIMOE_CHECK_D_FF  the train stage's model width and
#                       expert width (the cluster file's 256 and 1024)
#   HIMOE_CHECK_TRAIN_ARGS  more trainer flags (e.g. a bigger --batch_size)
#   HIMOE_CHECK_TARGETS what the build stage builds (the other stages' binaries)
#   HIMOE_CHECK_DEVICES the train stage's expert devices ("cuda:0 cpu"); the
#                       first two are compared
#   HIMOE_CHECK_CTEST_ARGS  the suite stage's ctest arguments (default: -j nproc/4,
#                       300 s a test; OMP_NUM_THREADS=4 and OMP_WAIT_POLICY=PASSIVE
#                       unless set); its log is ${OUT}/suite.log
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"
B="${HIMOE_CUDA_BUILD:-${ROOT}/build-cuda}"
OUT="${OUT:-/tmp/himoe-cuda-check}"
P="${HIMOE_DEPS_PREFIX:-/opt/himoe-deps}"
L="${P}/usr/lib/x86_64-linux-gnu"
mkdir -p "${OUT}"
t0=${SECONDS}
say() { echo "== [$((SECONDS - t0)) s] $*"; }

# The build dependencies of scripts/setup.sh that a CUDA image lacks, with the
# shared libraries they need (Debian bookworm names).
DEBS=(
  libabsl-dev libabsl20220623 libc-ares-dev libc-ares2 libcivetweb1 libcivetweb-dev
  libgflags-dev libgflags2.2 libgmock-dev libgtest-dev googletest libgoogle-glog-dev
  libgoogle-glog0v6 libgrpc++-dev libgrpc++1.51 libgrpc-dev libgrpc29
  libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libprometheus-cpp-push1.0
  prometheus-cpp-dev libprotobuf-dev libprotobuf-lite32 libprotobuf32 libprotoc32
  protobuf-compiler protobuf-compiler-grpc libre2-9 libre2-dev libssl-dev libssl3
  libunwind8 libunwind-dev pkgconf pkgconf-bin libpkgconf3 zlib1g zlib1g-dev
  nlohmann-json3-dev libcurl4-openssl-dev libcurl4 libbrotli1 libgssapi-krb5-2
  libidn2-0 libldap-2.5-0 libnghttp2-14 libpsl5 librtmp1 libssh2-1 libzstd1 libsasl2-2
  libsasl2-modules-db libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2
  libgnutls30 libhogweed6 libnettle8 libgmp10 libp11-kit0 libtasn1-6 libunistring2
  libdb5.3
)

fetch-debs() {
  local dir="$1"
  mkdir -p "${dir}" && (cd "${dir}" && apt-get download "${DEBS[@]}")
}

# Unpacks HIMOE_DEBS into P, keeping only the shared libraries the system
# lacks (the system's copy of a soname is newer and compatible).
unpack_debs() {
  [[ -n "${HIMOE_DEBS:-}" ]] || return 0
  say "unpacking ${HIMOE_DEBS} into ${P}"
  mkdir -p "${P}"
  for f in "${HIMOE_DEBS}"/*.deb; do dpkg-deb -x "$f" "${P}"; done
  local so name sys
  # bookworm still ships some libraries in /lib: one folder for all.
  for so in "${P}"/lib/x86_64-linux-gnu/*; do
    [[ -e "${so}" || -L "${so}" ]] || continue
    [[ -e "${L}/$(basename "${so}")" ]] || cp -a "${so}" "${L}/"
  done
  for so in "${L}"/*.so.*; do
    name=$(basename "${so}")
    if [[ -e /usr/lib/x86_64-linux-gnu/${name} || -e /lib/x86_64-linux-gnu/${name} ]]; then
      rm -f "${so}"
    fi
  done
  for so in "${L}"/*.so; do
    [[ -L "${so}" && ! -e "${so}" ]] || continue
    name=$(basename "${so}")
    sys=$(ls /usr/lib/x86_64-linux-gnu/"${name}".* /lib/x86_64-linux-gnu/"${name}".* 2>/dev/null | head -1)
    if [[ -n "${sys}" ]]; then ln -sf "${sys}" "${so}"; else echo "dangling: ${so}"; fi
  done
  # prometheus-cpp's CMake config imports civetweb's targets, its server binary too.
  [[ -e "${P}/usr/bin/civetweb" ]] || touch "${P}/usr/bin/civetweb"
}

deps_env() {
  [[ -n "${HIMOE_DEBS:-}" ]] || return 0
  export LD_LIBRARY_PATH="${L}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
  export PKG_CONFIG_PATH="${L}/pkgconfig:${P}/usr/share/pkgconfig"
  export PKG_CONFIG_LIBDIR="${PKG_CONFIG_PATH}" PKG_CONFIG_SYSROOT_DIR="${P}"
  export PKG_CONFIG_ALLOW_SYSTEM_CFLAGS=1 PKG_CONFIG_ALLOW_SYSTEM_LIBS=1
  export PATH="${PATH}:${P}/usr/bin"
}

build() {
  unpack_debs
  deps_env
  local torch="${HIMOE_TORCH_PREFIX:-$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)}"
  local prefix="${torch}" extra=()
  if [[ -n "${HIMOE_DEBS:-}" ]]; then
    prefix="${P}/usr;${torch}"
    extra=(-DPKG_CONFIG_EXECUTABLE="${P}/usr/bin/pkgconf"
           -DProtobuf_PROTOC_EXECUTABLE="${P}/usr/bin/protoc"
           -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,${L}"
           -DCMAKE_SHARED_LINKER_FLAGS="-Wl,-rpath-link,${L}"
           # abseil 20220623's headers predate GCC 13's leaner <string>
           -DCMAKE_CXX_FLAGS="-include cstdint")
  fi
  say "configure (LibTorch: ${torch:-found by CMake})"
  cmake -S . -B "${B}" -G Ninja -DCMAKE_BUILD_TYPE=Release -DHIMOE_BUILD_BENCHMARKS=OFF \
    ${prefix:+-DCMAKE_PREFIX_PATH="${prefix}"} "${extra[@]}" > "${OUT}/configure.log" 2>&1 \
    || { tail -40 "${OUT}/configure.log"; return 1; }
  say build
  # shellcheck disable=SC2086
  ninja -C "${B}" -k 0 ${HIMOE_CHECK_TARGETS:-common_test metrics_tls_test expert_service_test \
    himoe_expert_main himoe_trainer_main himoe_cluster_main himoe_router_main} \
    > "${OUT}/build.log" 2>&1 \
    || { grep -E "error|FAILED" "${OUT}/build.log" | head -60; return 1; }
}

tests() {
  deps_env
  say "CUDA tests"
  local log="${OUT}/tests.log"
  "${B}/tests/expert_service/expert_service_test" --gtest_filter='*Cuda*' > "${log}" 2>&1 &&
    "${B}/tests/common/common_test" \
      --gtest_filter='*Cuda*:MetricsInTorchProcessTest.Serves*:MetricsInTorchProcessTest.Unknown*' \
      >> "${log}" 2>&1 &&
    "${B}/tests/common/metrics_tls_test" >> "${log}" 2>&1 &&
    bash tests/no_std_filesystem_test.sh "${B}/expert_service/himoe-expert" \
      "${B}/router_service/himoe-router" "${B}/trainer/himoe-trainer" \
      "${B}/deploy/local/himoe-cluster" >> "${log}" 2>&1
  local rc=$?
  grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|loaded TLS|^ok: |^FAIL: " "${log}"
  if [[ ${rc} -ne 0 ]] || grep -q SKIPPED "${log}"; then return 1; fi
}

# One short training run of the cluster file's model (deploy/local/cluster.textproto)
# with its 4 expert groups, started here as himoe-expert processes, on DEVICE;
# metrics to ${OUT}/metrics-DEVICE.jsonl, a checkpoint every 10 steps. The
# trainer dials the groups itself (no router); each group serves /metrics on a
# port it picks, so a group whose endpoint cannot start beside this LibTorch
# fails the check.
train_on() {
  local dev="$1" d="${OUT}/train-${1/:/}" g pids=() ready
  say "training with the experts on ${dev}"
  rm -rf "${d}" && mkdir -p "${d}"
  local dm="${HIMOE_CHECK_D_MODEL:-256}" dff="${HIMOE_CHECK_D_FF:-1024}"
  sed -e "s/device: \"cpu\"/device: \"${dev}\"/" -e 's/5006\([0-9]\)/5106\1/' \
      -e "s/d_model: 256 /d_model: ${dm} /" -e "s/d_ff: 1024 /d_ff: ${dff} /" \
      deploy/local/cluster.textproto > "${d}/cluster.textproto"
  for g in 0 1 2 3; do
    "${B}/expert_service/himoe-expert" --address="127.0.0.1:5106$((g + 1))" --group_id="${g}" \
      --num_groups=4 --num_experts=8 --num_layers=2 --d_model="${dm}" --d_ff="${dff}" --seed=1 \
      --dtype=float32 --device="${dev}" --threads=3 --port_file="${d}/expert-${g}.port" \
      --metrics_port=0 \
      > "${d}/expert-${g}.log" 2>&1 &
    pids+=($!)
  done
  for _ in $(seq 90); do
    ready=$(ls "${d}"/expert-*.port 2>/dev/null | wc -l)
    [[ ${ready} -eq 4 ]] && break
    sleep 1
  done
  if [[ ${ready} -ne 4 ]]; then
    tail -3 "${d}"/expert-*.log; kill -INT "${pids[@]}" 2>/dev/null; wait; return 1
  fi
  "${B}/trainer/himoe-trainer" --experts=cluster --cluster "${d}/cluster.textproto" --n_layer 2 \
    --steps 20 --eval_every 20 --eval_windows 16 --log_every 10 --data README.md \
    --checkpoint_every 10 \
    --threads "${HIMOE_TRAIN_THREADS:-4}" --out_dir "${d}/run" ${HIMOE_CHECK_TRAIN_ARGS:-} \
    > "${d}/trainer.log" 2>&1
  local rc=$?
  kill -INT "${pids[@]}"; wait
  grep -h "serving on" "${d}/expert-0.log"
  grep -h -m1 "BLAS" "${d}/trainer.log"
  tail -3 "${d}/trainer.log"
  [[ ${rc} -eq 0 ]] && cp "${d}/run/metrics.jsonl" "${OUT}/metrics-${dev/:/}.jsonl"
}

train() {
  deps_env
  local devs=(${HIMOE_CHECK_DEVICES:-cuda:0 cpu}) dev
  for dev in "${devs[@]}"; do train_on "${dev}" || return 1; done
  [[ ${#devs[@]} -ge 2 ]] || return 0
  say "${devs[0]} against ${devs[1]} experts"
  python3 - "${OUT}" "${devs[0]/:/}" "${devs[1]/:/}" <<'EOF'
import json, sys
def losses(path):
    out = {}
    for line in open(path):
        rec = json.loads(line)
        for key in ('loss', 'val_loss'):
            if key in rec:
                out[(key, rec['step'])] = rec[key]
    return out
gpu, cpu = (losses(f'{sys.argv[1]}/metrics-{d}.jsonl') for d in sys.argv[2:4])
keys = sorted(k for k in gpu if k in cpu)
worst = max(abs(gpu[k] - cpu[k]) for k in keys)
for k in keys[:2] + keys[-2:]:
    print(f'{k[0]} step {k[1]}: {sys.argv[2]} {gpu[k]:.6f} {sys.argv[3]} {cpu[k]:.6f}')
print(f'{len(keys)} losses compared, max |{sys.argv[2]} - {sys.argv[3]}| = {worst:.2e}')
sys.exit(0 if keys and worst <= 1e-2 else 1)
EOF
}

# The test suite under ctest against this LibTorch. Tests that assume the
# set-up command's Debian machine (the system BLAS, /usr/bin/python3 with
# grpcio, fortunes, prometheus, gnuplot) fail elsewhere; the summary names
# every failure. A test's LibTorch takes every core unless told, and its
# OpenMP threads spin while they wait: with many tests at once, each on every
# core, tests that take well under a second alone run past their time-outs.
# Hence 4 threads a test, passive waiting, and a quarter of the cores' tests
# at once (see docs/benchmarks.md, Measurements behind choices in the code).
suite() {
  deps_env
  say "test suite"
  local jobs=$(( $(nproc) / 4 ))
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
  # shellcheck disable=SC2086
  (cd "${B}" && ctest --output-on-failure \
    ${HIMOE_CHECK_CTEST_ARGS:--j $(( jobs > 0 ? jobs : 1 )) --timeout 300} \
    > "${OUT}/suite.log" 2>&1)
  local rc=$?
  grep -E "tests passed|\*\*\*Failed|\*\*\*Timeout|Exception|Not Run" "${OUT}/suite.log" | head -60
  return ${rc}
}

if [[ "${1:-}" == fetch-debs ]]; then
  fetch-debs "${2:?usage: cuda_check.sh fetch-debs DIR}"
  exit
fi
stages=("$@")
[[ $# -gt 0 ]] || stages=(build tests train)
for s in "${stages[@]}"; do
  "${s}" || { say "${s} failed"; exit 1; }
done
say "all passed"
