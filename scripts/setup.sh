#!/usr/bin/env bash
# Installs the build dependencies (Debian bookworm packages), selects BLIS as
# the system BLAS and builds the project into build/. Safe to re-run.
#
#   HIMOE_SKIP_APT=1  skip apt-get (packages already installed)
#   HIMOE_JOBS=N      parallel build jobs (default: nproc)
#   HIMOE_BUILD_BENCHMARKS=OFF  skip the benchmark executables (scripts/test.sh)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libtorch-dev libdnnl-dev libgloo-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libabsl-dev prometheus-cpp-dev libcurl4-openssl-dev libssl-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  libblis4-openmp libgoogle-glog-dev libgflags-dev
  python3 python3-grpcio python3-grpc-tools python3-protobuf python3-numpy
  fortunes fortunes-min
  prometheus gnuplot-nox python3-yaml iproute2 openssl
  clang libclang-rt-14-dev
)

log() { echo "[setup] $*"; }

# phase NAME COMMAND...: runs COMMAND and reports how long it took.
phase() {
  local name="$1"
  shift
  local start=${SECONDS}
  log "${name}..."
  "$@"
  log "${name}: done in $((SECONDS - start)) s"
}

as_root() {
  if [[ ${EUID} -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null; then
    sudo "$@"
  else
    log "needs root: $*" >&2
    return 1
  fi
}

install_packages() {
  local packages=("${PACKAGES[@]}")
  # kubectl renders the Kubernetes manifests (kubectl kustomize). Debian's
  # kubernetes-client ships /usr/bin/kubectl, so it would clash with a kubectl
  # another package (e.g. google-cloud-sdk) already put there.
  if ! command -v kubectl >/dev/null; then
    packages+=(kubernetes-client)
  fi
  as_root apt-get update
  as_root env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends "${packages[@]}"
}

multiarch() {
  if command -v dpkg-architecture >/dev/null; then
    dpkg-architecture -qDEB_HOST_MULTIARCH
  else
    gcc -dumpmachine
  fi
}

# select_alternative NAME PATH: makes PATH the alternative for NAME unless it
# already is.
select_alternative() {
  local name="$1" path="$2" current
  current="$(readlink -f "/etc/alternatives/${name}" 2>/dev/null || true)"
  if [[ "${current}" == "${path}" ]]; then
    log "${name} already -> ${path}"
  else
    as_root update-alternatives --set "${name}" "${path}"
  fi
}

# LibTorch links libblas.so.3/liblapack.so.3; Debian's default reference BLAS
# is unoptimised, BLIS is several times faster for the matmuls we run. Its
# OpenMP build shares LibTorch's thread pool; the pthreads build starts threads
# on every call, slower on 2 threads than on 1 for a training step's products.
# The programs pick BLIS's kernels at start (common/compute_setup.h).
select_blas() {
  local arch blis_blas lapack
  arch="$(multiarch)"
  blis_blas="/usr/lib/${arch}/blis-openmp/libblas.so.3"
  if [[ ! -e "${blis_blas}" ]]; then
    log "BLIS not installed (${blis_blas} missing); leaving libblas as is" >&2
    return 0
  fi
  select_alternative "libblas.so.3-${arch}" "${blis_blas}"

  # BLIS ships no LAPACK; use one built on it if present, else keep the current.
  lapack="$(update-alternatives --list "liblapack.so.3-${arch}" 2>/dev/null \
    | grep -m1 '/blis' || true)"
  if [[ -n "${lapack}" ]]; then
    select_alternative "liblapack.so.3-${arch}" "${lapack}"
  else
    log "no BLIS LAPACK alternative; liblapack.so.3 stays" \
      "$(readlink -f "/usr/lib/${arch}/liblapack.so.3" || echo unset)"
  fi
  log "libblas.so.3 -> $(readlink -f "/usr/lib/${arch}/libblas.so.3")"
}

configure() {
  cmake -S "${ROOT}" -B "${ROOT}/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DHIMOE_BUILD_BENCHMARKS="${HIMOE_BUILD_BENCHMARKS:-ON}" -DHIMOE_UNITY_BUILD=ON
}

build() {
  cmake --build "${ROOT}/build" -j "${HIMOE_JOBS:-$(nproc)}"
}

main() {
  local start=${SECONDS}
  if [[ "${HIMOE_SKIP_APT:-0}" == 1 ]]; then
    log "HIMOE_SKIP_APT=1: skipping apt-get"
  else
    phase "apt-get install" install_packages
  fi
  phase "select BLAS" select_blas
  phase "configure" configure
  phase "build" build
  log "total: $((SECONDS - start)) s"
}

main "$@"
