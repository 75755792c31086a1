#!/usr/bin/env bash
# Sets up and builds the project (scripts/setup.sh), then runs the test suite.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

bash "${ROOT}/scripts/setup.sh"
exec ctest --test-dir "${ROOT}/build" --output-on-failure -j2
