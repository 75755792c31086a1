#!/usr/bin/env bash
# The README's main job with a tiny step count: a local cluster of expert
# processes, the fortunes corpus, the progress line, the final report, the
# plots.
set -euo pipefail
out="$(mktemp -d)"
trap 'rm -rf "${out}"' EXIT
log="${out}/stderr.log"
HIMOE_RUN_DIR="${out}/run" bash "$1/scripts/main_job.sh" \
  --steps 6 --eval_every 3 --eval_windows 8 --batch_size 4 --log_every 1 \
  --checkpoint_every 3 --profile 2>"${log}" || { cat "${log}"; exit 1; }
cat "${log}"
grep -q "experts: 4 himoe-expert processes on 127.0.0.1:" "${log}"
grep -q "step 6/6 | loss" "${log}"
grep -q "Routing balance over the last" "${log}"
grep -q "validation: loss" "${log}"
# One JSON line per step plus the evaluations at steps 0, 3 and 6.
test "$(grep -c '"kind":"train"' "${out}/run/metrics.jsonl")" -eq 6
test "$(grep -c '"kind":"eval"' "${out}/run/metrics.jsonl")" -eq 3
test -f "${out}/run/checkpoints/step_00000006/MANIFEST"
grep -q "checkpoint: ${out}/run/checkpoints/step_00000003 written in [0-9]* ms" "${log}"
# Utilisation: the compute set-up, MFU per step, peak RSS of the coordinator
# and each of the 4 expert processes.
grep -q "compute: .* threads (BLAS .*), .*GEMM rate" "${log}"
grep -q "| MFU [0-9]*% |" "${log}"
grep -q '"kind":"compute".*"gemm_gflops":[1-9]' "${out}/run/metrics.jsonl"
# (MFU may exceed 1 when the start-up GEMM probe ran on a loaded machine.)
grep '"kind":"train"' "${out}/run/metrics.jsonl" | tail -1 | grep -Eq '"mfu":([1-9]|0\.[0-9]*[1-9])'
grep -q '"kind":"memory","coordinator_peak_rss_mib":[1-9][0-9.]*,"expert_peak_rss_mib":\[[1-9][0-9.]*,[1-9][0-9.]*,[1-9][0-9.]*,[1-9][0-9.]*\]' \
  "${out}/run/metrics.jsonl"
grep -q "peak RSS: coordinator [0-9]* MiB, expert processes [0-9]*, [0-9]*, [0-9]*, [0-9]* MiB" "${log}"
# CPU a step of the coordinator and each expert process over the timed steps
# (from the sixth; the run's evaluation and checkpoint at step 6 left out).
grep -Eq '"kind":"cpu","steps":1,"wall_s":[0-9.e-]+,"cores":[1-9][0-9]*,"coordinator_core_ms_per_step":[0-9.]+,"expert_core_ms_per_step":\[[0-9.]+,[0-9.]+,[0-9.]+,[0-9.]+\],"used_fraction":[0-9.]+' \
  "${out}/run/metrics.jsonl"
grep -Eq "CPU per step over 1 step: coordinator [0-9.]+ core-ms, expert processes [0-9.]+, [0-9.]+, [0-9.]+, [0-9.]+ core-ms; [0-9]+% of [1-9][0-9]* cores' [0-9.]+ core-ms" "${log}"
# --profile: 3 of the 6 steps, by category, RPC time included.
grep -q "Where a training step's time goes (3 steps, local experts)" "${out}/run/profile.md"
for row in attention experts "expert RPC: wait" "routing, aux losses" "grad norm, optimizer"; do
  grep -q "^| ${row} | [0-9.]* | [0-9.]* | [0-9.]* |" "${out}/run/profile.md"
done
# The run drawn with gnuplot: PNG images.
for image in loss heatmap group_share; do
  head -c 8 "${out}/run/plots/${image}.png" | od -An -tx1 | grep -q "89 50 4e 47 0d 0a 1a 0a"
done
# Every expert process the trainer started is gone.
if pgrep -f -- "${out}" >/dev/null; then
  echo "expert processes left behind" >&2
  exit 1
fi
echo "smoke test passed"
