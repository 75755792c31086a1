#!/usr/bin/env bash
# Builds everything with AddressSanitizer and UndefinedBehaviorSanitizer
# (-DHIMOE_SANITIZE=ON, GCC) into build-sanitize/ and runs the whole test
# suite there, leak checks on. The binaries that tests start (expert
# processes, routers, trainers) are the sanitized ones, so a report in any of
# them fails its test. About 25 minutes to build and 9 to run on 2 cores;
# not part of .ci/run. Run scripts/setup.sh first (the packages).
#
# Three tests do not apply to a sanitized build and are left out:
#   Cli.MetricsBesideBigTls: preloads a library, and ASan's runtime must come
#     first in the list of loaded libraries;
#   MallocTuningTest.TheHeapIsKeptForReuse: ASan's allocator refuses glibc's
#     mallopt (the set-up then reports "mallopt refused", as it should);
#   Kubernetes.Manifests: the sanitized binaries need libasan and libubsan,
#     which the Docker image's runtime stage rightly does not install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${ROOT}/build-sanitize"

start=${SECONDS}
cmake -S "${ROOT}" -B "${BUILD}" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DHIMOE_SANITIZE=ON >/dev/null
cmake --build "${BUILD}" -j "${HIMOE_JOBS:-$(nproc)}"
echo "[sanitize] built in $((SECONDS - start)) s"
start=${SECONDS}
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir "${BUILD}" --output-on-failure -j2 --timeout 900 \
  -E '^(Cli\.MetricsBesideBigTls|MallocTuningTest\.TheHeapIsKeptForReuse|Kubernetes\.Manifests)$'
echo "[sanitize] the suite ran clean in $((SECONDS - start)) s"
