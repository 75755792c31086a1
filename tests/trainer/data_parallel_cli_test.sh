#!/usr/bin/env bash
# himoe-trainer as 2 data-parallel ranks (experts in process) on 127.0.0.1:
# - rank 0 by flags (serving the rendezvous on a free port), rank 1 by the
#   torchrun environment: the step losses of 1 rank accumulating 2
#   micro-batches, to 1e-4;
# - stopped by SIGTERM to rank 0 alone, both ranks stop after the same step,
#   rank 0's checkpoint resumes both, and the run ends with the bytes of an
#   uninterrupted 2-rank run;
# - rank 1 SIGKILLed mid-run: rank 0 fails naming it, and no process is left;
# - --ranks 2 with --experts=local: one set of expert processes, the losses of
#   1 rank with --grad_accum 2; an expert process SIGKILLed is restarted with
#   both ranks, which resume from the newest checkpoint and end byte for byte
#   as the uninterrupted run; with --on_group_failure=fail it ends the run
#   naming its group, with no process left.
set -euo pipefail
trainer="${HIMOE_BUILD_DIR}/trainer/himoe-trainer"
out="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "${p}" 2>/dev/null || true; done
  rm -rf "${out}"
}
trap cleanup EXIT
flags=(--experts=inprocess --n_layer 2 --d_model 32 --d_ff 64 --dense_ff 64 --n_head 2
       --num_experts 4 --num_groups 2 --block_size 32 --batch_size 4 --eval_every 100
       --eval_windows 4 --log_every 100 --blas_probe=false --threads 1 --dist_timeout_s 60)

# Waits for rank 0's rendezvous port in its log `$1`; prints it.
rendezvous_port() {
  for _ in $(seq 1 600); do
    if grep -q 'rendezvous: serving on port' "$1" 2>/dev/null; then
      grep -o 'rendezvous: serving on port [0-9]*' "$1" | awk '{print $5}'
      return 0
    fi
    sleep 0.05
  done
  echo "rank 0 never served the rendezvous" >&2
  cat "$1" >&2
  return 1
}
# The "loss" of every train line of a run log, one per line.
losses() { grep '"kind":"train"' "$1" | sed 's/.*"loss":\([^,]*\),.*/\1/'; }
# Waits until run log `$1` has step `$2`.
wait_step() {
  for _ in $(seq 1 1200); do
    grep -q "\"kind\":\"train\",\"step\":$2," "$1" 2>/dev/null && return 0
    sleep 0.05
  done
  echo "step $2 never logged in $1" >&2
  return 1
}
# Starts 2 ranks writing to `$1` with the remaining flags; sets pid0, pid1.
start_ranks() {
  local dir="$1"
  shift
  "${trainer}" "${flags[@]}" "$@" --world_size 2 --rank 0 --master_port 0 --out_dir "${dir}" \
    2>"${dir}.rank0.log" &
  pid0=$!
  pids+=("${pid0}")
  local port
  port="$(rendezvous_port "${dir}.rank0.log")"
  RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="${port}" \
    "${trainer}" "${flags[@]}" "$@" --out_dir "${dir}" 2>"${dir}.rank1.log" &
  pid1=$!
  pids+=("${pid1}")
}
# Waits for both ranks; sets status0, status1.
wait_ranks() {
  status0=0
  status1=0
  wait "${pid0}" || status0=$?
  wait "${pid1}" || status1=$?
}
show() { for f in "$@"; do echo "== ${f}"; cat "${f}"; done; }

# 1 rank, 2 micro-batches of 4 a step.
"${trainer}" "${flags[@]}" --grad_accum 2 --steps 30 --out_dir "${out}/one" 2>"${out}/one.log" \
  || { show "${out}/one.log"; exit 1; }

# 2 ranks, 1 micro-batch of 4 each.
start_ranks "${out}/two" --steps 30 --checkpoint_every 30
wait_ranks
if [[ "${status0}" -ne 0 || "${status1}" -ne 0 ]]; then
  show "${out}/two.rank0.log" "${out}/two.rank1.log"
  exit 1
fi
grep -q 'rank 1: trained to step 30' "${out}/two.rank1.log"
test -s "${out}/two/rank1/metrics.jsonl"
test -d "${out}/two/checkpoints/step_00000030"
paste <(losses "${out}/one/metrics.jsonl") <(losses "${out}/two/metrics.jsonl") |
  awk '{ d = $1 - $2; if (d < 0) d = -d; if (NF != 2 || d > 1e-4) { print "step " NR ": " $1 " vs " $2; bad = 1 } }
       END { if (NR != 30) { print NR " steps"; bad = 1 } exit bad }'
# Both ranks logged the same (summed) step losses.
cmp <(losses "${out}/two/metrics.jsonl") <(losses "${out}/two/rank1/metrics.jsonl")

# SIGTERM to rank 0 alone: both stop after the same step; both resume from
# rank 0's checkpoint and end as the uninterrupted run, byte for byte.
start_ranks "${out}/stopped" --steps 30 --checkpoint_every 30
wait_step "${out}/stopped/metrics.jsonl" 2
kill -TERM "${pid0}"
wait_ranks
test "${status0}" -eq 143 || { show "${out}/stopped.rank0.log"; exit 1; }
test "${status1}" -eq 143 || { show "${out}/stopped.rank1.log"; exit 1; }
stopped="$(grep -o 'stopped by SIGTERM after step [0-9]*' "${out}/stopped.rank0.log" | awk '{print $6}')"
grep -q "stopped by SIGTERM after step ${stopped} of 30" "${out}/stopped.rank1.log"
echo "stopped after step ${stopped} of 30"
if [[ "${stopped}" -lt 30 ]]; then
  test -d "${out}/stopped/checkpoints/$(printf 'step_%08d' "${stopped}")"
  start_ranks "${out}/stopped" --steps 30 --checkpoint_every 30 --resume
  wait_ranks
  if [[ "${status0}" -ne 0 || "${status1}" -ne 0 ]]; then
    show "${out}/stopped.rank0.log" "${out}/stopped.rank1.log"
    exit 1
  fi
  grep -q "resumed from .*step_$(printf '%08d' "${stopped}") at step ${stopped}" \
    "${out}/stopped.rank1.log"
fi
final=checkpoints/step_00000030
for f in dense.pt experts_g0.pt experts_g1.pt data.txt; do
  cmp "${out}/stopped/${final}/${f}" "${out}/two/${final}/${f}"
done

# Rank 1 killed: rank 0 fails, naming it.
start_ranks "${out}/killed" --steps 100000
wait_step "${out}/killed/metrics.jsonl" 2
kill -KILL "${pid1}"
wait_ranks
if [[ "${status0}" -eq 0 ]] || ! grep -q 'rank 1 stopped' "${out}/killed.rank0.log"; then
  show "${out}/killed.rank0.log"
  exit 1
fi
grep -o 'data parallel: .*' "${out}/killed.rank0.log" | head -1
for p in "${pids[@]}"; do
  if kill -0 "${p}" 2>/dev/null; then
    echo "process ${p} left behind" >&2
    exit 1
  fi
done
# --ranks 2 with local experts: one set of expert processes for both ranks,
# the losses of 1 rank with --grad_accum 2.
"${trainer}" "${flags[@]}" --experts=local --grad_accum 2 --steps 6 --out_dir "${out}/local_one" \
  2>"${out}/local_one.log" || { show "${out}/local_one.log"; exit 1; }
"${trainer}" "${flags[@]}" --experts=local --ranks 2 --steps 6 --out_dir "${out}/local_two" \
  2>"${out}/local_two.log" || { show "${out}/local_two.log" "${out}/local_two/rank1.log"; exit 1; }
grep -q 'rank 1: trained to step 6' "${out}/local_two/rank1.log"
test "$(grep -c 'himoe-expert processes on' "${out}/local_two.log")" -eq 1
paste <(losses "${out}/local_one/metrics.jsonl") <(losses "${out}/local_two/metrics.jsonl") |
  awk '{ d = $1 - $2; if (d < 0) d = -d; if (NF != 2 || d > 1e-4) { print "step " NR ": " $1 " vs " $2; bad = 1 } }
       END { if (NR != 6) { print NR " steps"; bad = 1 } exit bad }'

# An expert group SIGKILLed under 2 ranks, --on_group_failure=wait_and_resume
# (the default with local experts): the launcher restarts the group and both
# ranks from the newest checkpoint, and the run ends byte for byte as an
# uninterrupted one.
"${trainer}" "${flags[@]}" --experts=local --ranks 2 --steps 24 --checkpoint_every 4 \
  --out_dir "${out}/healed_plain" 2>"${out}/healed_plain.log" ||
  { show "${out}/healed_plain.log"; exit 1; }
"${trainer}" "${flags[@]}" --experts=local --ranks 2 --steps 24 --checkpoint_every 4 \
  --out_dir "${out}/healed" 2>"${out}/healed.log" &
launcher=$!
pids+=("${launcher}")
wait_step "${out}/healed/metrics.jsonl" 6
kill -KILL "$(cat "${out}/healed/experts/expert-1.pid")"
wait "${launcher}" || { show "${out}/healed.log"; exit 1; }
grep -q 'expert group failure (1 of at most 3 recovered)' "${out}/healed.log"
grep -q 'resumed from .*/step_[0-9]* at step [0-9]*' "${out}/healed.log"
for f in dense.pt experts_g0.pt experts_g1.pt data.txt; do
  cmp "${out}/healed/checkpoints/step_00000024/${f}" "${out}/healed_plain/checkpoints/step_00000024/${f}"
done

# The same with --on_group_failure=fail: the run ends with an error naming the
# group, and the launcher leaves no process behind.
"${trainer}" "${flags[@]}" --experts=local --ranks 2 --steps 100000 --on_group_failure=fail \
  --out_dir "${out}/group_killed" 2>"${out}/group_killed.log" &
launcher=$!
pids+=("${launcher}")
wait_step "${out}/group_killed/metrics.jsonl" 2
kill -KILL "$(cat "${out}/group_killed/experts/expert-1.pid")"
status=0
wait "${launcher}" || status=$?
if [[ "${status}" -eq 0 ]] || ! grep -q 'expert group 1' "${out}/group_killed.log"; then
  show "${out}/group_killed.log" "${out}/group_killed/rank1.log"
  exit 1
fi
grep 'himoe-trainer: ' "${out}/group_killed.log" | tail -2
if pgrep -f -- "${out}/group_killed" >/dev/null; then
  echo "processes left behind:" >&2
  pgrep -af -- "${out}/group_killed" >&2
  exit 1
fi
echo "data-parallel CLI test passed"
