#!/usr/bin/env bash
# The routing-method study: every routing method, the Hi-MoE
# presets, the balance controller and the ablation from MoGE, trained with
# in-process experts at one fixed config and 3 seeds, then summarised by
# scripts/repro_report.py into <out>/results.md, results.csv, runs.csv and
# plots/.
#
#   bash scripts/repro.sh                 # full: 16 rows x 3 seeds (about 2 hours on 2 cores)
#   bash scripts/repro.sh --quick         # seed 1337; vanilla, moge, himoe, himoe+controller (~25 min)
#   bash scripts/repro.sh --smoke         # every row, 1 seed, 2 steps (what CI runs)
#   options: --out DIR (default runs/repro)  --jobs N (default 2)
#            --rows a,b,...  --seeds s1,s2,...
#            --report_only (start no run: redraw the report from the finished
#            runs, listing the others as missing)
#
# Each run is one single-threaded himoe-trainer (--threads 1) in
# <out>/runs/<row>/seed<seed>/ (metrics.jsonl, train.log, args); --jobs of
# them run at once. Rerunning the command resumes the study: a run whose
# metrics.jsonl holds the last step's train line and a final eval line, and
# whose args file equals this invocation's flags, is kept; any other run
# directory is deleted and that run starts again from step 0.
# The trainer is $HIMOE_BUILD_DIR/trainer/himoe-trainer (default build/).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# --- The fixed config: the authors' released-code setup on the fortunes bytes ---------
# (4 layers, d 128, block 128, batch 16, N=8 experts in M=4 groups, k=1 per
# group (K=4), lr 1e-3, 600 steps). Warmup 30 steps (5%) and a cosine decay to
# min_lr = lr/10 (nanoGPT's convention); every other flag is pinned so that a
# change of the trainer's defaults does not move the study.
STEPS=600
EVAL_EVERY=100
EVAL_WINDOWS=64
SEEDS=1337,1338,1339
CONFIG=(--experts=inprocess --threads 1 --data /usr/share/games/fortunes
        --n_layer 4 --d_model 128 --n_head 4 --block_size 128 --batch_size 16
        --num_experts 8 --num_groups 4 --top_k 1 --d_ff 512 --dense_ff 512 --moe_every 1
        --lr 1e-3 --min_lr 1e-4 --warmup 30 --weight_decay 0.1 --grad_clip 1 --grad_accum 1
        --val_fraction 0.1 --log_every 50)
# The rows, in table order: "label|trainer flags".
ROWS=(
  "vanilla|--method vanilla"
  "st_moe|--method st_moe"
  "loss_free|--method loss_free"
  "moge|--method moge"
  "himoe|--method himoe --target_expert_cv 0 --epsilon_ov 0 --epsilon_sys 0"
  "himoe-reference|--method himoe --preset reference --target_expert_cv 0 --epsilon_ov 0 --epsilon_sys 0"
  "moge-reference|--method moge --preset reference"
  "vanilla-reference|--method vanilla --preset reference"
  "st_moe-reference|--method st_moe --preset reference"
  "loss_free-reference|--method loss_free --preset reference"
  "himoe+controller|--method himoe --target_expert_cv 0.1 --epsilon_ov 0.8 --epsilon_sys 0.3"
  "himoe+dual|--method himoe --target_expert_cv 0 --epsilon_ov 0.8 --epsilon_sys 0.3"
  "himoe+controller-fixed|--method himoe --target_expert_cv 0.1 --epsilon_ov 0 --epsilon_sys 0"
  "moge+bias_corr|--method himoe --lambda_intra 0 --lambda_inter 0 --target_expert_cv 0 --epsilon_ov 0 --epsilon_sys 0"
  "moge+R_intra|--method himoe --tau 0 --lambda_inter 0 --target_expert_cv 0 --epsilon_ov 0 --epsilon_sys 0"
  "moge+R_inter|--method himoe --tau 0 --lambda_intra 0 --target_expert_cv 0 --epsilon_ov 0 --epsilon_sys 0"
)
QUICK_ROWS=vanilla,moge,himoe,himoe+controller
QUICK_SEEDS=1337

usage() { sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

die() { echo "repro.sh: $*" >&2; exit 2; }

# --- Command line ---------------------------------------------------------------------
MODE=full
REPORT_ONLY=0
OUT="${ROOT}/runs/repro"
JOBS=2
ROWS_ARG=""
SEEDS_ARG=""
while (($#)); do
  case "$1" in
    --quick) MODE=quick ;;
    --smoke) MODE=smoke ;;
    --report_only) REPORT_ONLY=1 ;;
    --full) MODE=full ;;
    --out) (($# >= 2)) || die "--out needs a directory"; OUT="$2"; shift ;;
    --out=*) OUT="${1#*=}" ;;
    --jobs) (($# >= 2)) || die "--jobs needs a number"; JOBS="$2"; shift ;;
    --jobs=*) JOBS="${1#*=}" ;;
    --rows) (($# >= 2)) || die "--rows needs a list"; ROWS_ARG="$2"; shift ;;
    --rows=*) ROWS_ARG="${1#*=}" ;;
    --seeds) (($# >= 2)) || die "--seeds needs a list"; SEEDS_ARG="$2"; shift ;;
    --seeds=*) SEEDS_ARG="${1#*=}" ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
[[ "${JOBS}" =~ ^[1-9][0-9]*$ ]] || die "--jobs must be a positive integer, not '${JOBS}'"

case "${MODE}" in
  quick) SELECT_ROWS="${QUICK_ROWS}"; SEEDS="${QUICK_SEEDS}" ;;
  smoke) SELECT_ROWS=""; SEEDS="${SEEDS%%,*}"; STEPS=2; EVAL_EVERY=2; EVAL_WINDOWS=2 ;;
  full) SELECT_ROWS="" ;;
esac
[[ -n "${ROWS_ARG}" ]] && SELECT_ROWS="${ROWS_ARG}"
[[ -n "${SEEDS_ARG}" ]] && SEEDS="${SEEDS_ARG}"

declare -A ROW_FLAGS=()
ALL_LABELS=()
for r in "${ROWS[@]}"; do
  ROW_FLAGS["${r%%|*}"]="${r#*|}"
  ALL_LABELS+=("${r%%|*}")
done
LABELS=()
if [[ -z "${SELECT_ROWS}" ]]; then
  LABELS=("${ALL_LABELS[@]}")
else
  IFS=, read -r -a wanted <<<"${SELECT_ROWS}"
  for w in "${wanted[@]}"; do
    [[ -n "${ROW_FLAGS[${w}]+x}" ]] || die "unknown row '${w}' (rows: ${ALL_LABELS[*]})"
  done
  for l in "${ALL_LABELS[@]}"; do  # table order
    for w in "${wanted[@]}"; do [[ "${w}" == "${l}" ]] && { LABELS+=("${l}"); break; }; done
  done
fi
IFS=, read -r -a SEED_LIST <<<"${SEEDS}"
((${#SEED_LIST[@]})) || die "no seeds"
for s in "${SEED_LIST[@]}"; do [[ "${s}" =~ ^[0-9]+$ ]] || die "bad seed '${s}'"; done

TRAINER="${HIMOE_BUILD_DIR:-${ROOT}/build}/trainer/himoe-trainer"
[[ -x "${TRAINER}" ]] || die "${TRAINER} not found (build first: bash scripts/setup.sh)"
mkdir -p "${OUT}"
OUT="$(cd "${OUT}" && pwd)"
RUN_LEN=(--steps "${STEPS}" --eval_every "${EVAL_EVERY}" --eval_windows "${EVAL_WINDOWS}")

# The trainer's flags of one run (without --out_dir): what its args file holds.
run_args() {  # label seed
  local -a row
  read -r -a row <<<"${ROW_FLAGS[$1]}"
  printf '%s\n' "${CONFIG[@]}" "${RUN_LEN[@]}" --seed "$2" "${row[@]}"
}

# A run is finished when it was made with these very flags and its
# metrics.jsonl has the last step's train line and an eval line at that step.
finished() {  # dir label seed
  local m="$1/metrics.jsonl"
  [[ -f "${m}" && -f "$1/args" ]] || return 1
  [[ "$(cat "$1/args")" == "$(run_args "$2" "$3")" ]] || return 1
  grep -q "^{\"kind\":\"train\",\"step\":${STEPS}," "${m}" &&
    grep -q "^{\"kind\":\"eval\",\"step\":${STEPS}," "${m}"
}

duration() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# --- The runs -------------------------------------------------------------------------
TODO=()
kept=0
for label in "${LABELS[@]}"; do
  for seed in "${SEED_LIST[@]}"; do
    dir="${OUT}/runs/${label}/seed${seed}"
    if finished "${dir}" "${label}" "${seed}"; then
      kept=$((kept + 1))
    else
      TODO+=("${label}|${seed}")
    fi
  done
done
((REPORT_ONLY)) && TODO=()
total=$((${#LABELS[@]} * ${#SEED_LIST[@]}))
echo "repro.sh: ${MODE} study, ${#LABELS[@]} rows x ${#SEED_LIST[@]} seeds (${SEEDS}), ${STEPS} steps;" \
  "${kept} of ${total} runs already finished, ${#TODO[@]} to run, ${JOBS} at a time -> ${OUT}"

declare -A PID_RUN=() PID_START=()
FAILED=()
done_count=${kept}
study_start=${SECONDS}

REPORT_PID=""
# shellcheck disable=SC2317  # invoked by the trap
stop_all() {
  trap - INT TERM
  local pids=("${!PID_RUN[@]}")
  if ((${#pids[@]})); then
    echo "repro.sh: stopping ${#pids[@]} run(s); they start again from step 0 next time" >&2
  fi
  [[ -n "${REPORT_PID}" ]] && pids+=("${REPORT_PID}")
  if ((${#pids[@]})); then
    kill -TERM "${pids[@]}" 2>/dev/null || true
    for p in "${pids[@]}"; do wait "${p}" 2>/dev/null || true; done
  fi
  exit 130
}
trap stop_all INT TERM

start_run() {  # label seed
  local dir="${OUT}/runs/$1/seed$2"
  rm -rf "${dir}"
  mkdir -p "${dir}"
  run_args "$1" "$2" >"${dir}/args"
  local -a args
  mapfile -t args <"${dir}/args"
  "${TRAINER}" "${args[@]}" --out_dir "${dir}" >"${dir}/train.log" 2>&1 &
  PID_RUN[$!]="$1|$2"
  PID_START[$!]=${SECONDS}
}

reap_one() {
  local pid="" rc=0
  wait -n -p pid "${!PID_RUN[@]}" || rc=$?
  [[ -n "${pid}" ]] || return 0
  local run="${PID_RUN[${pid}]}" took=$((SECONDS - PID_START[${pid}]))
  unset "PID_RUN[${pid}]" "PID_START[${pid}]"
  local label="${run%|*}" seed="${run#*|}"
  local dir="${OUT}/runs/${label}/seed${seed}"
  done_count=$((done_count + 1))
  if ((rc == 0)) && finished "${dir}" "${label}" "${seed}"; then
    local ppl
    ppl="$(grep "^{\"kind\":\"eval\",\"step\":${STEPS}," "${dir}/metrics.jsonl" | tail -n 1 |
           sed -n 's/.*"val_ppl":\([^,}]*\).*/\1/p')"
    echo "[${done_count}/${total}] ${label} seed ${seed}: done in $(duration "${took}"), val ppl ${ppl}" \
      "(study $(duration $((SECONDS - study_start))))"
  else
    FAILED+=("${label} seed ${seed}")
    echo "[${done_count}/${total}] ${label} seed ${seed}: FAILED (exit ${rc}) after $(duration "${took}");" \
      "last lines of ${dir}/train.log:" >&2
    tail -n 15 "${dir}/train.log" | sed 's/^/    /' >&2
  fi
}

for run in "${TODO[@]}"; do
  while ((${#PID_RUN[@]} >= JOBS)); do reap_one; done
  start_run "${run%|*}" "${run#*|}"
done
while ((${#PID_RUN[@]})); do reap_one; done

# --- The report -----------------------------------------------------------------------
REPORT=(/usr/bin/python3 "${ROOT}/scripts/repro_report.py" --out "${OUT}" --steps "${STEPS}"
        --seeds "${SEEDS}" --mode "${MODE}"
        --config "$(printf '%s ' "${CONFIG[@]}" "${RUN_LEN[@]}" | sed 's/ $//')")
for label in "${LABELS[@]}"; do REPORT+=(--row "${label}|${ROW_FLAGS[${label}]}"); done
report_rc=0
"${REPORT[@]}" &  # in the background, so that a stop signal reaches it at once
REPORT_PID=$!
wait "${REPORT_PID}" || report_rc=$?
REPORT_PID=""
trap - INT TERM
if ((${#FAILED[@]})); then
  echo "repro.sh: ${#FAILED[@]} run(s) failed: $(IFS=,; echo "${FAILED[*]}"); rerun the command" \
    "to retry them (finished runs are kept)" >&2
  exit 1
fi
exit "${report_rc}"
