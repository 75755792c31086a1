#!/usr/bin/env bash
# Throughput against the authors' released code, back to back on this machine:
# their train.py (method himoe: moge with the Hi-MoE penalty and regularizers,
# top-1 per group, capacity 2.0) and himoe-trainer in process, on the released
# code's config (4 layers, d 128, block 128, batch 16, 8 experts in 4 groups,
# width 512), with 2 and then 1 thread each, REPS times. Prints, per run, the
# released code's median ms per iteration (6-40) and himoe-trainer's median
# tokens/s (steps 6-40) and MFU.
#
#   git clone https://github.com/brain-lab-research/Hi-MoE /path/Hi-MoE   # once
#   CODE=/path/Hi-MoE bash scripts/released/throughput.sh
#
# Env: CODE (required), REPS (2), ITERS (45), OUT (runs/released_throughput),
# HIMOE_FLAGS (extra himoe-trainer flags, e.g. "--matmul_dtype bfloat16"),
# RELEASED_FLAGS (extra run_released.py flags, e.g. "--cpu_autocast_bf16").
# Needs Debian's python3-torch and a built himoe-trainer (scripts/setup.sh).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "${HERE}/../.." && pwd)"
BUILD="${HIMOE_BUILD_DIR:-${ROOT}/build}"
CODE="${CODE:-}"
REPS="${REPS:-2}"
ITERS="${ITERS:-45}"
OUT="${OUT:-${ROOT}/runs/released_throughput}"
PY=/usr/bin/python3
[[ -n "${CODE}" && -f "${CODE}/train.py" ]] || {
  echo "throughput.sh: CODE must name a checkout of github.com/brain-lab-research/Hi-MoE" \
    "(got '${CODE}')" >&2; exit 2; }
DATA="${ROOT}/runs/released/data"
[[ -f "${DATA}/val.bin" ]] || "${PY}" "${HERE}/prepare_fortunes.py" --out "${DATA}"
mkdir -p "${OUT}"
released_env=(PYTHONPATH="${HERE}" PYTHONUNBUFFERED=1 BLIS_ARCH_TYPE="${BLIS_ARCH_TYPE:-0}"
  MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=268435456
  MALLOC_TOP_PAD_=16777216 MALLOC_MMAP_MAX_=0)
for rep in $(seq 1 "${REPS}"); do
  for t in 2 1; do
    name="released-t${t}-r${rep}"
    env "${released_env[@]}" OMP_NUM_THREADS="${t}" BLIS_NUM_THREADS="${t}" \
      "${PY}" "${HERE}/run_released.py" --method himoe --iters "${ITERS}" --out "${OUT}/${name}" \
      --checkout "${CODE}" --data "${DATA}" --eval_windows 8 --log_interval 1000 \
      ${RELEASED_FLAGS:-} >"${OUT}/${name}.log" 2>&1
    echo "${name}: $(grep -o '[0-9]* ms/iter, [0-9]* tok/s' "${OUT}/${name}.log")"
    name="himoe-t${t}-r${rep}"
    "${BUILD}/trainer/himoe-trainer" --experts=inprocess --threads "${t}" --n_layer 4 \
      --d_model 128 --n_head 4 --block_size 128 --batch_size 16 --num_experts 8 \
      --num_groups 4 --top_k 1 --d_ff 512 --moe_every 1 --lr 1e-3 --steps "${ITERS}" \
      --warmup 5 --eval_every 1000000 --eval_windows 8 --log_every 1000000 \
      ${HIMOE_FLAGS:-} --out_dir "${OUT}/${name}" >"${OUT}/${name}.log" 2>&1
    "${PY}" - "${OUT}/${name}/metrics.jsonl" "${name}" <<'PYEOF'
import json, statistics, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if r.get('kind') == 'train'][5:40]
print(f"{sys.argv[2]}: {statistics.median(r['tokens_per_s'] for r in steps):.0f} tok/s, "
      f"MFU {statistics.median(r.get('mfu', 0) for r in steps):.3f}")
PYEOF
  done
done
