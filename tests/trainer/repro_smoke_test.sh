#!/usr/bin/env bash
# scripts/repro.sh --smoke (the routing-method study, every row for 2 steps at
# one seed): results.md has a row of numbers per study row, the CSVs and the
# plots exist; a rerun keeps the finished runs, an unfinished run is redone.
#   repro_smoke_test.sh SOURCE_ROOT   (the trainer: $HIMOE_BUILD_DIR or SOURCE_ROOT/build)
set -euo pipefail
ROOT="$1"
out="$(mktemp -d)"
study="${out}/study"
log="${out}/log"
pid=""
cleanup() {
  if [[ -n "${pid}" ]]; then
    kill -TERM "${pid}" 2>/dev/null || true
    wait "${pid}" 2>/dev/null || true
  fi
  rm -rf "${out}"
}
trap cleanup EXIT
trap 'exit 143' INT TERM

# Runs repro.sh in the background (so that a stop signal reaches the trap) and
# prints its output.
repro() {
  local rc=0
  bash "${ROOT}/scripts/repro.sh" --smoke --out "${study}" "$@" >"${log}" 2>&1 &
  pid=$!
  wait "${pid}" || rc=$?
  pid=""
  cat "${log}"
  return "${rc}"
}

fail() { echo "FAIL: $*" >&2; exit 1; }

start=${SECONDS}
repro || fail "repro.sh --smoke exited with an error"
echo "repro.sh --smoke took $((SECONDS - start)) s"

ROWS=(vanilla st_moe loss_free moge himoe himoe-reference moge-reference vanilla-reference
      st_moe-reference loss_free-reference himoe+controller himoe+dual himoe+controller-fixed
      moge+bias_corr moge+R_intra
      moge+R_inter)
md="${study}/results.md"
[[ -f "${md}" ]] || fail "no ${md}"
# The main table: | row | runs | val CE | val PPL | expert CV (last 50) |
# expert CV (val) | MaxVio | group CV | groups/token | tokens/s |
number='^ *[0-9]+(\.[0-9]+)? *$'
for r in "${ROWS[@]}"; do
  line="$(grep -F -m1 "| ${r} | " "${md}")" || fail "results.md: no row '${r}'"
  IFS='|' read -r -a cells <<<"${line}"
  ((${#cells[@]} == 11)) || fail "results.md: row '${r}' has $((${#cells[@]} - 1)) cells: ${line}"
  [[ "${cells[2]}" =~ ^\ *1\ *$ ]] || fail "results.md: row '${r}': runs '${cells[2]}', want 1"
  for c in 3 4 5 6 7 8 9 10; do
    [[ "${cells[c]}" =~ ${number} ]] || fail "results.md: row '${r}', column ${c}: '${cells[c]}'"
  done
done
# Exactly those rows in the main table (rows start with "| <label> | 1 |").
n="$(grep -cE '^\| [^|]+ \| 1 \| ' "${md}")"
((n == ${#ROWS[@]})) || fail "results.md: ${n} table rows, want ${#ROWS[@]}"
(($(wc -l <"${study}/results.csv") == ${#ROWS[@]} + 1)) || fail "results.csv line count"
(($(wc -l <"${study}/runs.csv") == ${#ROWS[@]} + 1)) || fail "runs.csv line count"
grep -q "Missing runs" "${md}" && fail "results.md lists missing runs"

# The plots, as PNG, and their links in results.md.
is_png() { head -c 8 "$1" | od -An -tx1 | grep -q "89 50 4e 47 0d 0a 1a 0a"; }
images=(plots/ppl_vs_cv.png)
for r in vanilla moge himoe himoe+controller; do
  images+=("plots/${r}/heatmap.png" "plots/${r}/balance.png")
done
for i in "${images[@]}"; do
  is_png "${study}/${i}" || fail "${i} is not a PNG"
  grep -qF "](${i})" "${md}" || fail "results.md does not link ${i}"
done
# The controller's bias panel comes with himoe+controller only.
[[ -f "${study}/plots/himoe+controller/data/balance_bias.dat" ]] ||
  fail "himoe+controller: no balance_bias.dat"
[[ ! -f "${study}/plots/himoe/data/balance_bias.dat" ]] ||
  fail "himoe (controller off) has a balance_bias.dat"

# Resume: a rerun keeps every finished run; a run without its final eval
# line is redone from scratch.
repro || fail "the rerun exited with an error"
grep -q "${#ROWS[@]} of ${#ROWS[@]} runs already finished, 0 to run" "${log}" || fail "the rerun did not keep the runs"
m="${study}/runs/moge/seed1337/metrics.jsonl"
grep -v '"kind":"eval","step":2,' "${m}" >"${m}.cut"
mv "${m}.cut" "${m}"
repro --rows moge,himoe || fail "the partial rerun exited with an error"
grep -q "1 of 2 runs already finished, 1 to run" "${log}" || fail "an unfinished run was not redone"
grep -q '"kind":"eval","step":2,' "${m}" || fail "the redone run has no final eval"
test "$(grep -c '"kind":"config"' "${m}")" -eq 1 || fail "the redone run was appended to"

# Every process it started is gone.
if pgrep -f -- "${study}" >/dev/null; then
  fail "processes left behind: $(pgrep -af -- "${study}")"
fi
echo "repro smoke test passed"
