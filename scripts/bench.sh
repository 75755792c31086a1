#!/usr/bin/env bash
# The project's throughput bench, one command, every number from one run.
#
#   scripts/bench.sh train [--steps N] [--out DIR] [-- extra himoe-trainer flags]
#   scripts/bench.sh soak [scripts/soak.py flags: --seconds 60 --rate 100 ...]
#   scripts/bench.sh startup [--reps N]
#   scripts/bench.sh generate [himoe-generate-bench flags]
#   scripts/bench.sh serve [himoe-serve-bench flags]
#
# train: back to back, on the released code's config (4 layers, d 128, block
# 128, batch 16, 8 experts in 4 groups, K 4, width 512) and on the main job's
# config, himoe-trainer with the experts in process (2 threads and 1 thread)
# and in 4 local expert processes. Each run measures the machine's GEMM rate
# at start; the table gives tokens/s (median step after warm-up), model
# GFLOP/s, MFU against that rate, remote / in-process, 2 / 1 threads, and the
# peak RSS of the coordinator and the expert processes. Writes
# <out>/train_bench.md (the README's table) and the runs' metrics.jsonl.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${HIMOE_BUILD_DIR:-${ROOT}/build}"
TRAINER="${BUILD}/trainer/himoe-trainer"

usage() { sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }

[[ $# -ge 1 ]] || usage
mode="$1"; shift
if [[ "${mode}" == soak ]]; then
  # soak: serving under bounded load with a group killed and restarted
  # (scripts/soak.py); writes runs/bench/soak.md.
  exec /usr/bin/python3 "${ROOT}/scripts/soak.py" --build "${BUILD}" \
    --out "${ROOT}/runs/bench/soak.md" "$@"
fi
if [[ "${mode}" == startup ]]; then
  # startup: spawn-to-serving of himoe-expert and himoe-cluster, with and
  # without the cached BLIS kernel choice (scripts/startup_bench.py); writes
  # runs/bench/startup.md.
  exec /usr/bin/python3 "${ROOT}/scripts/startup_bench.py" --build "${BUILD}" \
    --out "${ROOT}/runs/bench/startup.md" "$@"
fi
if [[ "${mode}" == serve ]]; then
  # serve: RouteForward batching on/off, latency, routing, codec and M
  # scaling ratios (tests/bench/serve_bench.cc); writes runs/bench/serve.md.
  mkdir -p "${ROOT}/runs/bench"
  exec "${BUILD}/tests/bench/himoe-serve-bench" --out "${ROOT}/runs/bench/serve.md" "$@"
fi
if [[ "${mode}" == generate ]]; then
  # generate: Generate's decoding, KV cache vs full recompute and 8 concurrent
  # streams vs 1 (tests/bench/generate_bench.cc); writes runs/bench/generate.md.
  mkdir -p "${ROOT}/runs/bench"
  exec "${BUILD}/tests/bench/himoe-generate-bench" --out "${ROOT}/runs/bench/generate.md" "$@"
fi
[[ "${mode}" == train ]] || usage
steps=60
out="${ROOT}/runs/bench"
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    *) usage ;;
  esac
done
[[ -x "${TRAINER}" ]] || { echo "bench: ${TRAINER} not built (run scripts/setup.sh)" >&2; exit 1; }
mkdir -p "${out}"

declare -A CONFIGS=(
  [released]="--n_layer 4 --d_model 128 --n_head 4 --block_size 128 --batch_size 16
              --num_experts 8 --num_groups 4 --top_k 1 --d_ff 512 --moe_every 1 --lr 1e-3"
  [main]=""
)
runs=()
for config in released main; do
  for run in inprocess:0 inprocess:1 local:0; do
    experts="${run%%:*}" threads="${run##*:}"
    name="${config}-${experts}-t${threads}"
    echo "bench: ${name}" >&2
    # shellcheck disable=SC2086
    "${TRAINER}" --experts="${experts}" --threads "${threads}" ${CONFIGS[${config}]} \
      --steps "${steps}" --warmup 5 --eval_every 1000000 --eval_windows 8 --log_every 1000000 \
      --out_dir "${out}/${name}" "${extra[@]}" >"${out}/${name}.log" 2>&1 \
      || { echo "bench: ${name} failed; see ${out}/${name}.log" >&2; tail -5 "${out}/${name}.log" >&2; exit 1; }
    runs+=("${name}")
  done
done
/usr/bin/python3 "${ROOT}/scripts/bench_report.py" --out "${out}" "${runs[@]}"
