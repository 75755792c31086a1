#!/usr/bin/env bash
# Self-healing training (--on_group_failure=wait_and_resume, the default with
# --experts=local): an expert process killed mid-run is started again, the
# run reloads its last checkpoint and goes on, and its final weights equal
# those of an uninterrupted run with the same seed. Four micro-batches a step
# (--grad_accum 2, each batch split in two by default with remote experts),
# two at once (--micro_batches_in_flight's default): the kill finds calls of
# both in flight. Then again with --group_run_state: the restarted group
# serves the run from its run state file.
set -euo pipefail
trainer="${HIMOE_BUILD_DIR}/trainer/himoe-trainer"
out="$(mktemp -d)"
pid=""
cleanup() {
  if [[ -n "${pid}" ]]; then kill "${pid}" 2>/dev/null || true; wait "${pid}" 2>/dev/null || true; fi
  rm -rf "${out}"
}
trap cleanup EXIT
flags=(--experts=local --n_layer 2 --d_model 32 --d_ff 64 --dense_ff 64 --n_head 2
       --block_size 32 --batch_size 4 --grad_accum 2 --steps 24 --eval_every 8 --eval_windows 4
       --checkpoint_every 4 --keep_checkpoints 10 --log_every 100 --blas_probe=false)

# Trains into ${out}/$1 (extra flags after it) and kills group 1 (SIGKILL: no
# clean shutdown) once step 6 is logged: after the checkpoint of step 4 (and,
# on a busy machine, maybe of a later one). Its log goes to ${out}/$1.log.
train_and_kill_group_1() {
  local run="$1"
  shift
  "${trainer}" "${flags[@]}" "$@" --out_dir "${out}/${run}" 2>"${out}/${run}.log" &
  pid=$!
  for _ in $(seq 1 600); do
    grep -q '"kind":"train","step":6,' "${out}/${run}/metrics.jsonl" 2>/dev/null && break
    kill -0 "${pid}" 2>/dev/null || break
    sleep 0.05
  done
  kill -9 "$(cat "${out}/${run}/experts/expert-1.pid")"
  local status=0
  wait "${pid}" || status=$?
  pid=""
  cat "${out}/${run}.log"
  test "${status}" -eq 0
}

train_and_kill_group_1 healed
grep -q "micro-batches: 2 of each step's 4 at once" "${out}/healed.log"
grep -q "expert group failure at step" "${out}/healed.log"
grep -q "restarted expert group(s) 1" "${out}/healed.log"
# From the newest checkpoint before the failure (step 4, or 8 when the kill
# landed after that checkpoint on a busy machine).
resumed="$(grep -o 'resumed from .*/step_[0-9]* at step [0-9]*' "${out}/healed.log" | grep -o '[0-9]*$')"
[[ "${resumed}" == 4 || "${resumed}" == 8 || "${resumed}" == 12 ]]
test -f "${out}/healed/experts/expert-1.log.previous"
# metrics.jsonl counts every step once, and marks the resume once.
test "$(grep -c '"kind":"train"' "${out}/healed/metrics.jsonl")" -eq 24
for step in $(seq 1 24); do
  test "$(grep -c "\"kind\":\"train\",\"step\":${step}," "${out}/healed/metrics.jsonl")" -eq 1
done
test "$(grep -c '"kind":"resume"' "${out}/healed/metrics.jsonl")" -eq 1

"${trainer}" "${flags[@]}" --out_dir "${out}/plain" 2>"${out}/plain.log" || { cat "${out}/plain.log"; exit 1; }
final=checkpoints/step_00000024
for f in dense.pt experts_g0.pt experts_g1.pt experts_g2.pt experts_g3.pt data.txt; do
  cmp "${out}/healed/${final}/${f}" "${out}/plain/${final}/${f}"
done
# The same validation loss, to the printed digit.
test "$(grep -o 'validation: loss .*' "${out}/healed.log")" = "$(grep -o 'validation: loss .*' "${out}/plain.log")"
# With --group_run_state the restarted group serves the run again from its
# run state file (the failed step then runs again in place, unless the kill
# fell in the groups' Step or before its file was written), and the run ends
# as the uninterrupted one.
train_and_kill_group_1 kept --group_run_state
grep -q "restarted expert group(s) 1" "${out}/kept.log"
grep -Eq "run '.*' restored at step [0-9]+ from .*/experts/expert-1.run" \
  "${out}/kept/experts/expert-1.log"
grep -q "every expert group kept its state" "${out}/kept.log" &&
  echo "the failed step ran again in place" || echo "the failed step reloaded a checkpoint"
for step in $(seq 1 24); do
  test "$(grep -c "\"kind\":\"train\",\"step\":${step}," "${out}/kept/metrics.jsonl")" -eq 1
done
for f in dense.pt experts_g0.pt experts_g1.pt experts_g2.pt experts_g3.pt data.txt; do
  cmp "${out}/kept/${final}/${f}" "${out}/plain/${final}/${f}"
done
if pgrep -f -- "${out}" >/dev/null; then
  echo "expert processes left behind" >&2
  exit 1
fi
echo "self-heal test passed"
