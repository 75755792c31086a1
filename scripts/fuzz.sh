#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with clang into build-fuzz/ and
# runs each for SECONDS (default 30; `bash scripts/fuzz.sh 600` for 10
# minutes each) on its checked-in seeds (tests/fuzz/corpus/<target>); what
# each run discovers is kept in build-fuzz/corpus/<target>. The targets run
# side by side, one per core (HIMOE_FUZZ_JOBS). A crash fails the script,
# naming the reproducer (build-fuzz/crashes/<target>-crash-<sha1>), which
# `build-fuzz/tests/fuzz/<target> <file>` replays.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_EACH="${1:-30}"
BUILD="${ROOT}/build-fuzz"
FUZZERS=(cluster_config_fuzzer access_policy_fuzzer checkpoint_files_fuzzer tensor_codec_fuzzer
         expert_forward_fuzzer route_forward_fuzzer generate_fuzzer)

start=${SECONDS}
# -O1 with line tables: the optimisation libFuzzer's documentation suggests,
# and stack traces that name file and line; only the fuzzers' libraries.
cmake -S "${ROOT}" -B "${BUILD}" -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only -DNDEBUG" \
  -DHIMOE_FUZZ=ON -DHIMOE_BUILD_TESTS=OFF -DHIMOE_BUILD_BENCHMARKS=OFF \
  -DHIMOE_UNITY_BUILD=ON >/dev/null
cmake --build "${BUILD}" --target himoe_fuzzers
echo "[fuzz] built in $((SECONDS - start)) s"
mkdir -p "${BUILD}/crashes"

# fuzz_one NAME: runs one target; its log is build-fuzz/NAME.log.
fuzz_one() {
  local fuzzer="$1" corpus="${BUILD}/corpus/$1"
  mkdir -p "${corpus}"
  # LibTorch keeps per-thread caches across inputs: leak checks would report
  # them, so they are off; ASan's other checks stay on. One thread each: the
  # targets run side by side, one per core.
  OMP_NUM_THREADS=1 ASAN_OPTIONS=detect_leaks=0 "${BUILD}/tests/fuzz/${fuzzer}" \
    -max_total_time="${SECONDS_EACH}" \
    -timeout=10 -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="${BUILD}/crashes/${fuzzer}-" "${corpus}" \
    "${ROOT}/tests/fuzz/corpus/${fuzzer}" >"${BUILD}/${fuzzer}.log" 2>&1 || {
      tail -n 40 "${BUILD}/${fuzzer}.log"
      echo "[fuzz] ${fuzzer} FAILED; reproducer(s): $(ls "${BUILD}/crashes/${fuzzer}-"* 2>/dev/null)"
      return 1
    }
  local runs
  runs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "${BUILD}/${fuzzer}.log" | grep -o '[0-9]*$')"
  echo "[fuzz] ${fuzzer}: ${runs} inputs in ${SECONDS_EACH} s, no crash; corpus $(ls "${corpus}" | wc -l) files"
}

# HIMOE_FUZZ_JOBS targets at once (default: the number of cores).
jobs="${HIMOE_FUZZ_JOBS:-$(nproc)}"
failed=0
running=0
for fuzzer in "${FUZZERS[@]}"; do
  if (( running >= jobs )); then
    wait -n || failed=1
    running=$((running - 1))
  fi
  fuzz_one "${fuzzer}" &
  running=$((running + 1))
done
while (( running > 0 )); do
  wait -n || failed=1
  running=$((running - 1))
done
exit "${failed}"
