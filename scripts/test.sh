#!/usr/bin/env bash
# Installs the dependencies and builds the project (scripts/setup.sh, without
# the benchmark executables), runs the test suite (every entry bounded by its
# TIMEOUT), then builds and runs the fuzz targets (scripts/fuzz.sh). Prints
# the time of each phase; docs/testing.md explains where CI's time goes.
#
#   HIMOE_FUZZ_SECONDS=N  seconds per fuzz target (default 25)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
start=${SECONDS}

phase_start=${SECONDS}
HIMOE_BUILD_BENCHMARKS=OFF bash "${ROOT}/scripts/setup.sh"
echo "[test] set-up and build: $((SECONDS - phase_start)) s"

phase_start=${SECONDS}
ctest --test-dir "${ROOT}/build" --output-on-failure -j2 --timeout 600
echo "[test] ctest: $((SECONDS - phase_start)) s"

phase_start=${SECONDS}
bash "${ROOT}/scripts/fuzz.sh" "${HIMOE_FUZZ_SECONDS:-25}"
echo "[test] fuzz: $((SECONDS - phase_start)) s"
echo "[test] total: $((SECONDS - start)) s"
