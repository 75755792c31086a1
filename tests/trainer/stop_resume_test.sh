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

# Ctrl-C with checkpoints on: the checkpoint of the step it stopped after.
run_and_signal INT group "${out}/stopped" --checkpoint_every 25
test "${status}" -eq 130
line="$(grep -o 'stopped by SIGINT after step [0-9]* of 60; checkpoint .*' "${out}/stopped.log")"
stopped="$(sed 's/.*after step \([0-9]*\) of.*/\1/' <<<"${line}")"
[[ "${stopped}" -ge 6 && "${stopped}" -lt 60 ]]
checkpoint="${out}/stopped/checkpoints/$(printf 'step_%08d' "${stopped}")"
grep -qF "checkpoint ${checkpoint} (continue with --resume)" <<<"${line}"
test -f "${checkpoint}/dense.pt"
test "$(tail -1 "${out}/stopped/metrics.jsonl")" = \
  "{\"kind\":\"stop\",\"step\":${stopped},\"signal\":\"SIGINT\",\"checkpoint\":\"${checkpoint}\"}"
test "$(grep -c '"kind":"train"' "${out}/stopped/metrics.jsonl")" -eq "${stopped}"

"${trainer}" "${flags[@]}" --checkpoint_every 25 --resume --out_dir "${out}/stopped" \
  2>"${out}/resumed.log" || { cat "${out}/resumed.log"; exit 1; }
grep -q "resumed from ${checkpoint} at step ${stopped}" "${out}/resumed.log"
test "$(grep -c '"kind":"train"' "${out}/stopped/metrics.jsonl")" -eq 60

"${trainer}" "${flags[@]}" --checkpoint_every 25 --out_dir "${out}/plain" 2>"${out}/plain.log" \
  || { cat "${out}/plain.log"; exit 1; }
final=checkpoints/step_00000060
for f in dense.pt experts_g0.pt experts_g1.pt experts_g2.pt experts_g3.pt data.txt; do
  cmp "${out}/stopped/${final}/${f}" "${out}/plain/${final}/${f}"
done
# The same final validation loss, to the printed digit.
final_val() { grep -o 'validation: loss .*' "$1" | sed 's/.*-> \([0-9.]*\),.*/\1/'; }
test "$(final_val "${out}/resumed.log")" = "$(final_val "${out}/plain.log")"

# SIGINT inherited ignored, checkpoints off: it stops, saying there is
# nothing to resume from.
run_and_signal INT pid "${out}/nocheckpoint"
test "${status}" -eq 130
grep -q 'stopped by SIGINT after step [0-9]* of 60; no checkpoint (--checkpoint_every 0)' \
  "${out}/nocheckpoint.log"
test ! -e "${out}/nocheckpoint/checkpoints"

# SIGTERM: exit 143 and its checkpoint.
run_and_signal TERM pid "${out}/terminated" --checkpoint_every 25
test "${status}" -eq 143
grep -q 'stopped by SIGTERM after step [0-9]* of 60; checkpoint .*/step_000000[0-9][0-9] (continue with --resume)' \
  "${out}/terminated.log"
echo "stop and resume test passed"
