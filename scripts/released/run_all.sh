#!/usr/bin/env bash
# The authors' released Hi-MoE code (github.com/brain-lab-research/Hi-MoE) on
# the study's fixed config (scripts/repro.sh), measured the way himoe-trainer
# measures itself: pure validation cross-entropy on the same 64 windows of the
# same fortunes bytes, and expert CV per layer from hard counts. Their files
# are not edited (run_released.py patches from outside; sitecustomize.py stubs
# torch._dynamo and their plotting imports for Debian's torch 1.13).
#
#   git clone https://github.com/brain-lab-research/Hi-MoE /path/Hi-MoE   # once
#   CODE=/path/Hi-MoE bash scripts/released/run_all.sh     # vanilla, moge, himoe; seed 1337
#   CODE=... METHODS="vanilla moge himoe st_moe loss_free" SEEDS="1337 1338 1339" JOBS=2 \
#       bash scripts/released/run_all.sh
#
# Each run is single-threaded and nice'd, in OUT/<method>/seed<seed>/
# (train.log, metrics.jsonl, result.json, result.csv); OUT/results.csv gathers
# them. A run whose result.json has the same iterations is kept on a rerun.
# Env: CODE (required), METHODS (vanilla moge himoe), SEEDS (1337), ITERS
# (600), JOBS (1), OUT (runs/released), NICE (10), EXTRA (run_released.py flags).
# Needs Debian's python3-torch (apt-get install -y python3-torch).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "${HERE}/../.." && pwd)"
CODE="${CODE:-}"
METHODS="${METHODS:-vanilla moge himoe}"
SEEDS="${SEEDS:-1337}"
ITERS="${ITERS:-600}"
JOBS="${JOBS:-1}"
OUT="${OUT:-${ROOT}/runs/released}"
NICE="${NICE:-10}"
EXTRA="${EXTRA:-}"
PY=/usr/bin/python3

"${PY}" -c 'import torch' 2>/dev/null || {
  echo "run_all.sh: Debian's python3-torch is missing: apt-get install -y python3-torch" >&2; exit 2; }
[[ -n "${CODE}" && -f "${CODE}/train.py" ]] || {
  echo "run_all.sh: CODE must name a checkout of github.com/brain-lab-research/Hi-MoE" \
    "(got '${CODE}')" >&2; exit 2; }
DATA="${OUT}/data"
[[ -f "${DATA}/val.bin" ]] || "${PY}" "${HERE}/prepare_fortunes.py" --out "${DATA}"

export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 BLIS_NUM_THREADS=1
export BLIS_ARCH_TYPE="${BLIS_ARCH_TYPE:-0}"   # BLIS skx kernels (Debian BLIS picks generic otherwise)
export MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=268435456 MALLOC_TOP_PAD_=16777216
export MALLOC_MMAP_MAX_=0                     # their 32 MiB expert buffers would be mmap'd every step
export PYTHONPATH="${HERE}${PYTHONPATH:+:${PYTHONPATH}}"  # sitecustomize.py
export PYTHONUNBUFFERED=1

done_already() {  # dir
  [[ -f "$1/result.json" ]] && "${PY}" -c "import json,sys; sys.exit(json.load(open('$1/result.json'))['iterations'] != ${ITERS})"
}

fail=0
reap() {
  local rc=0
  wait -n || rc=$?
  ((rc == 0)) || fail=$((fail + 1))
}
for m in ${METHODS}; do
  for s in ${SEEDS}; do
    dir="${OUT}/${m}/seed${s}"
    if done_already "${dir}"; then echo "skip ${m} seed ${s} (done)"; continue; fi
    while (($(jobs -rp | wc -l) >= JOBS)); do reap; done
    mkdir -p "${dir}"
    echo "start ${m} seed ${s} -> ${dir}"
    # shellcheck disable=SC2086
    nice -n "${NICE}" "${PY}" "${HERE}/run_released.py" --method "${m}" --seed "${s}" \
      --iters "${ITERS}" --out "${dir}" --checkout "${CODE}" --data "${DATA}" ${EXTRA} >"${dir}/train.log" 2>&1 &
  done
done
while (($(jobs -rp | wc -l) > 0)); do reap; done

# gather
"${PY}" - "${OUT}" <<'PYEOF'
import csv, glob, os, sys
out = sys.argv[1]
rows = []
for f in sorted(glob.glob(os.path.join(out, '*', 'seed*', 'result.csv'))):
    with open(f) as fh:
        rows += list(csv.DictReader(fh))
if rows:
    keys = list(rows[0].keys())
    with open(os.path.join(out, 'results.csv'), 'w', newline='') as fh:
        w = csv.DictWriter(fh, fieldnames=keys); w.writeheader(); w.writerows(rows)
    for r in rows:
        print(f"{r['method']:>9} seed {r['seed']}: val CE {float(r['val_ce']):.4f}  expert CV last50 "
              f"{float(r['expert_cv_last']):.3f}  val {float(r['expert_cv_val']):.3f}  "
              f"{float(r['ms_per_iter_median_6_40']):.0f} ms/iter")
    print(f"-> {os.path.join(out, 'results.csv')}")
PYEOF
((fail == 0)) || { echo "run_all.sh: ${fail} run(s) failed; see their train.log" >&2; exit 1; }
