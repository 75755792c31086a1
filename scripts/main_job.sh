#!/usr/bin/env bash
# The main job: trains a small Hi-MoE language model on Debian's fortunes
# corpus. The coordinator (himoe-trainer) keeps the dense layers and routers;
# the experts live in 4 himoe-expert processes it starts on 127.0.0.1 and
# stops at exit. Then it draws the run with gnuplot (trainer/plot/himoe-plot).
# Extra flags go to himoe-trainer (e.g. --steps 100, --method moge,
# --metrics_port 9469); see `himoe-trainer --help`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${HIMOE_RUN_DIR:-${ROOT}/runs/main}"
"${HIMOE_BUILD_DIR:-${ROOT}/build}/trainer/himoe-trainer" --experts=local --out_dir "${OUT}" "$@"
"${ROOT}/trainer/plot/himoe-plot" "${OUT}" --out "${OUT}/plots"
