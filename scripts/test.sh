#!/usr/bin/env bash
# Sets up and builds the project (scripts/setup.sh), then runs the test suite
# and the fuzz targets (scripts/fuzz.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

bash "${ROOT}/scripts/setup.sh"
ctest --test-dir "${ROOT}/build" --output-on-failure -j2
# The libFuzzer targets, HIMOE_FUZZ_SECONDS (30) each, on their seed corpora.
bash "${ROOT}/scripts/fuzz.sh" "${HIMOE_FUZZ_SECONDS:-30}"
