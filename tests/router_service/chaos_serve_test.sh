#!/usr/bin/env bash
# A short serving chaos run (scripts/chaos.sh serve): 60 s of RouteForward and
# Generate load on a router serving a checkpoint from 4 namespace hosts, 9
# seeded faults of every kind (expert and router SIGKILL/SIGTERM/SIGSTOP, a
# link down, a link at a trickle, a group's connections reset). Passes when
# every answer equals the in-process reference (or is a clear status naming
# the group), no call outlives the deadline, and serving resumes within 2 s
# of each return. Needs root; skipped (exit 77) otherwise.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="$(mktemp -d)"
trap 'rm -rf "${out}"' EXIT
status=0
bash "${root}/scripts/chaos.sh" serve --seed 3 --seconds 60 --interval 6 \
  --out "${out}/chaos.md" || status=$?
[[ ${status} -eq 77 ]] && exit 77
test "${status}" -eq 0
grep -q '| faults fired | 9 of 9 |' "${out}/chaos.md"
grep -q '| wrong answers | 0 |' "${out}/chaos.md"
grep -q '| errors without a clear status | 0 |' "${out}/chaos.md"
grep -q '| calls past the deadline | 0 |' "${out}/chaos.md"
# Answers of both kinds were checked against the reference.
grep -Eq '^\| answers equal to the reference: RouteForward / Generate \| [1-9][0-9]* / [1-9][0-9]* \|' \
  "${out}/chaos.md"
