#!/usr/bin/env bash
# Builds the tests of the project's concurrent code with ThreadSanitizer
# (-DHIMOE_SANITIZE_THREAD=ON, GCC) into build-tsan/ and runs them: the
# shared-memory region pool, the router's batcher, pipelined dispatch,
# Generate's continuous batching and the router service over real gRPC, the
# expert service's compute pool and queue, micro-batch turns, remote
# training (the group calls' fan-out, micro-batches in flight, from the
# autograd engine's threads), Generate through the batcher, the compute
# pool and ParallelFor. Not part of .ci/run (about 25 minutes to build on 2
# cores). Run scripts/setup.sh first (the packages).
#
# LibTorch, gRPC, abseil and libgomp come uninstrumented from Debian: TSan
# sees their mutexes (pthread, intercepted) but not their atomics, so a
# hand-off through one of them looks like a race. Torch runs on one thread
# here (no OpenMP team), and scripts/tsan.supp names what is left out, each
# with its reason. A report anywhere else fails the script.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${ROOT}/build-tsan"
TESTS=(router_service_test router_test expert_service_test trainer_unit_test trainer_test
       generate_test model_test common_test)
# common_test: its concurrent parts only. The rest includes death tests and
# signal tests that fork a threaded process, which hang under TSan, the
# kernel probe's forked children ("no answer") and a peak-RSS test that TSan's
# allocator changes. router_service_test without the Python client's and the
# TLS cases (child processes, OpenSSL's uninstrumented atomics); of the
# trainer's units, the micro-batch hand-off.
declare -A FILTER=(
  [common_test]="ComputePool*:ParallelFor*:*Gelu*:*SharedMemory*:Countdown*"
  [router_service_test]="-PythonClientTest.*:TlsTest.*"
  [expert_service_test]="-ExpertMetricsTest.*"
  [trainer_unit_test]="MicroBatchTurnsTest.*"
)

start=${SECONDS}
cmake -S "${ROOT}" -B "${BUILD}" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DHIMOE_SANITIZE_THREAD=ON -DHIMOE_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "${BUILD}" -j "${HIMOE_JOBS:-$(nproc)}" --target "${TESTS[@]}"
echo "[tsan] built in $((SECONDS - start)) s"
logs="${BUILD}/tsan-logs"
rm -rf "${logs}" && mkdir -p "${logs}"
failed=()
for t in "${TESTS[@]}"; do
  bin="$(find "${BUILD}/tests" -type f -name "${t}" -perm -u+x | head -1)"
  start=${SECONDS}
  if OMP_NUM_THREADS=1 \
     TSAN_OPTIONS="suppressions=${ROOT}/scripts/tsan.supp ignore_noninstrumented_modules=1 halt_on_error=0 second_deadlock_stack=1 exitcode=66 log_path=${logs}/${t}" \
     "${bin}" --gtest_filter="${HIMOE_TSAN_FILTER:-${FILTER[${t}]:-*}}" >"${logs}/${t}.out" 2>&1; then
    echo "[tsan] ${t}: clean in $((SECONDS - start)) s"
  else
    echo "[tsan] ${t}: FAILED (rc $?) in $((SECONDS - start)) s; ${logs}/${t}.out and ${logs}/${t}.*"
    failed+=("${t}")
  fi
done
[[ ${#failed[@]} -eq 0 ]] || { echo "[tsan] reports or failures in: ${failed[*]}"; exit 1; }
echo "[tsan] every test ran clean"
