#!/usr/bin/env bash
# A stop signal between steps: himoe-trainer writes a checkpoint of the steps
# since the last one, a "stop" line in metrics.jsonl, stops its expert
# processes and exits 128 + the signal; --resume then ends with the weights of
# an uninterrupted run. Three ways a stop comes:
# - a terminal's Ctrl-C, SIGINT to the whole foreground process group (job
#   control gives the trainer a group of its own here): the expert processes
#   must not take it, or the step in flight fails without them;
# - SIGINT to the trainer alone, started without job control, which starts
#   background commands with SIGINT ignored: the trainer must take it anyway;
# - SIGTERM, as Kubernetes sends.
set -euo pipefail
trainer="${HIMOE_BUILD_DIR}/trainer/himoe-trainer"
out="$(mktemp -d)"
pid=""
cleanup() {
  if [[ -n "${pid}" ]]; then kill -9 "${pid}" 2>/dev/null || true; wait "${pid}" 2>/dev/null || true; fi
  rm -rf "${out}"
}
trap cleanup EXIT
flags=(--experts=local --n_layer 2 --d_model 32 --d_ff 64 --dense_ff 64 --n_head 2
       --block_size 32 --batch_size 4 --steps 60 --eval_every 20 --eval_windows 4
       --keep_checkpoints 10 --log_every 100 --blas_probe=false)

# Starts the trainer in the background; once step 6 is logged sends `sig` to
# it (`to` = pid) or to its process group (`to` = group, with job control on);
# sets `status` to its exit status.
run_and_signal() {
  local sig="$1" to="$2" dir="$3"
  shift 3
  [[ "${to}" == group ]] && set -m
  "${trainer}" "${flags[@]}" "$@" --out_dir "${dir}" 2>"${dir}.log" &
  pid=$!
  set +m
  for _ in $(seq 1 600); do
    grep -q '"kind":"train","step":6,' "${dir}/metrics.jsonl" 2>/dev/null && break
    kill -0 "${pid}" 2>/dev/null || break
    sleep 0.05
  done
  if [[ "${to}" == group ]]; then
    test "$(ps -o pgid= -p "${pid}" | tr -d ' ')" = "${pid}"
    kill "-${sig}" -- "-${pid}"
  else
    kill "-${sig}" "${pid}"
  fi
  status=0
  wait "${pid}" || status=$?
  pid=""
  cat "${dir}.log"
  if pgrep -f -- "${dir}" >/dev/null; then
    echo "expert processes left behind" >&2
    exit 1
  fi
}

# The checkpoint a stop left (`dir`, `sig`, its log line): every file the
# MANIFEST lists, each with the right sha256, the MANIFEST listing exactly the
# checkpoint's files, and the stop line in metrics.jsonl. Sets `stopped` and
# `checkpoint`.
check_stop_checkpoint() {
  local dir="$1" sig="$2"
  local line
  line="$(grep -o "stopped by SIG${sig} after step [0-9]* of 60; checkpoint .*" "${dir}.log")"
  stopped="$(sed 's/.*after step \([0-9]*\) of.*/\1/' <<<"${line}")"
  [[ "${stopped}" -ge 6 && "${stopped}" -lt 60 ]]
  checkpoint="${dir}/checkpoints/$(printf 'step_%08d' "${stopped}")"
  grep -qF "checkpoint ${checkpoint} (continue with --resume)" <<<"${line}"
  for f in MANIFEST meta.textproto dense.pt optimizer.pt data.txt experts_g0.pt experts_g1.pt \
           experts_g2.pt experts_g3.pt; do
    test -s "${checkpoint}/${f}" || { echo "${checkpoint}/${f} missing" >&2; exit 1; }
  done
  test "$(awk '{print $2}' "${checkpoint}/MANIFEST" | sed 's/^\*//' | sort | tr '\n' ' ')" = \
    "$(ls "${checkpoint}" | grep -v '^MANIFEST$' | sort | tr '\n' ' ')"
  (cd "${checkpoint}" && sha256sum --check --quiet --strict MANIFEST)
  test "$(tail -1 "${dir}/metrics.jsonl")" = \
    "{\"kind\":\"stop\",\"step\":${stopped},\"signal\":\"SIG${sig}\",\"checkpoint\":\"${checkpoint}\"}"
  test "$(grep -c '"kind":"train"' "${dir}/metrics.jsonl")" -eq "${stopped}"
}

# --resume from the stop's checkpoint runs to step 60 and ends with the files
# and the validation loss of the uninterrupted run in `${out}/plain`.
resume_and_compare() {
  local dir="$1"
  "${trainer}" "${flags[@]}" --checkpoint_every 25 --resume --out_dir "${dir}" \
    2>"${dir}.resumed.log" || { cat "${dir}.resumed.log"; exit 1; }
  grep -q "resumed from ${checkpoint} at step ${stopped}" "${dir}.resumed.log"
  test "$(grep -c '"kind":"train"' "${dir}/metrics.jsonl")" -eq 60
  local final=checkpoints/step_00000060
  for f in dense.pt experts_g0.pt experts_g1.pt experts_g2.pt experts_g3.pt data.txt; do
    cmp "${dir}/${final}/${f}" "${out}/plain/${final}/${f}"
  done
  # The same final validation loss, to the printed digit.
  test "$(final_val "${dir}.resumed.log")" = "$(final_val "${out}/plain.log")"
}
final_val() { grep -o 'validation: loss .*' "$1" | sed 's/.*-> \([0-9.]*\),.*/\1/'; }

# The uninterrupted run both resumed runs must end as.
"${trainer}" "${flags[@]}" --checkpoint_every 25 --out_dir "${out}/plain" 2>"${out}/plain.log" \
  || { cat "${out}/plain.log"; exit 1; }

# Ctrl-C with checkpoints on: the checkpoint of the step it stopped after.
run_and_signal INT group "${out}/stopped" --checkpoint_every 25
test "${status}" -eq 130
check_stop_checkpoint "${out}/stopped" INT
resume_and_compare "${out}/stopped"

# SIGINT inherited ignored, checkpoints off: it stops, saying there is
# nothing to resume from.
run_and_signal INT pid "${out}/nocheckpoint"
test "${status}" -eq 130
grep -q 'stopped by SIGINT after step [0-9]* of 60; no checkpoint (--checkpoint_every 0)' \
  "${out}/nocheckpoint.log"
test ! -e "${out}/nocheckpoint/checkpoints"

# SIGTERM, as Kubernetes sends: exit 143, its checkpoint, and a resume that
# ends as the uninterrupted run.
run_and_signal TERM pid "${out}/terminated" --checkpoint_every 25
test "${status}" -eq 143
check_stop_checkpoint "${out}/terminated" TERM
resume_and_compare "${out}/terminated"
echo "stop and resume test passed"
