#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with clang into build-fuzz/ and
# runs each for SECONDS (default 30; `bash scripts/fuzz.sh 600` for 10
# minutes each) on its checked-in seeds (tests/fuzz/corpus/<target>); what
# each run discovers is kept in build-fuzz/corpus/<target>. A crash stops the
# script, naming the reproducer (build-fuzz/crashes/<target>-crash-<sha1>),
# which `build-fuzz/tests/fuzz/<target> <file>` replays.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SECONDS_EACH="${1:-30}"
BUILD="${ROOT}/build-fuzz"
FUZZERS=(cluster_config_fuzzer checkpoint_files_fuzzer tensor_codec_fuzzer
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
for fuzzer in "${FUZZERS[@]}"; do
  corpus="${BUILD}/corpus/${fuzzer}"
  mkdir -p "${corpus}"
  # LibTorch keeps per-thread caches across inputs: leak checks would report
  # them, so they are off; ASan's other checks stay on.
  ASAN_OPTIONS=detect_leaks=0 "${BUILD}/tests/fuzz/${fuzzer}" -max_total_time="${SECONDS_EACH}" \
    -timeout=10 -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="${BUILD}/crashes/${fuzzer}-" "${corpus}" \
    "${ROOT}/tests/fuzz/corpus/${fuzzer}" >"${BUILD}/${fuzzer}.log" 2>&1 || {
      tail -n 40 "${BUILD}/${fuzzer}.log"
      echo "[fuzz] ${fuzzer} FAILED; reproducer(s): $(ls "${BUILD}/crashes/${fuzzer}-"* 2>/dev/null)"
      exit 1
    }
  runs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "${BUILD}/${fuzzer}.log" | grep -o '[0-9]*$')"
  echo "[fuzz] ${fuzzer}: ${runs} inputs in ${SECONDS_EACH} s, no crash; corpus $(ls "${corpus}" | wc -l) files"
done
