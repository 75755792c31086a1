#!/usr/bin/env bash
# A short chaos run (scripts/chaos.sh train): 9 seeded faults of every kind
# (expert and trainer SIGKILL/SIGTERM/SIGSTOP, a link down, a link at a
# trickle, a group's connections reset) over 60 steps on namespace hosts,
# then a group down past --group_wait_s. Passes when the run ends by itself
# with a final checkpoint bit-identical to the fault-free run's, every step
# once in the run log with the fault-free losses, failed steps ran again in
# place (every group kept its state, or a restarted one got it back from its
# run state file) as well as from checkpoints, and the
# unhealable fault ended the trainer naming the group and its last good
# checkpoint. Needs root; skipped (exit 77) otherwise.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out="$(mktemp -d)"
trap 'rm -rf "${out}"' EXIT
status=0
bash "${root}/scripts/chaos.sh" train --seed 7 --faults 9 --steps 60 --out "${out}/chaos.md" ||
  status=$?
[[ ${status} -eq 77 ]] && exit 77
test "${status}" -eq 0
grep -q '| faults fired | 9 of 9 |' "${out}/chaos.md"
grep -q '| final checkpoint sha256 equal to the fault-free run.s | yes |' "${out}/chaos.md"
grep -q '| run log: steps 1..60 once, losses equal | yes |' "${out}/chaos.md"
# Both recoveries ran: a failed step again in place, and checkpoint reloads.
grep -Eq '^\| failed steps run again in place / checkpoint reloads .* \| [1-9][0-9]* / [1-9][0-9]* \|$' \
  "${out}/chaos.md"
# Restarted expert processes served the run again from their run state files.
grep -Eq '^\| expert restarts / of them serving the run again .* \| [1-9][0-9]* / [1-9][0-9]* \|$' \
  "${out}/chaos.md"
grep -q 'did not all serve again within 10 s: expert group 0 .*last good checkpoint is ' \
  "${out}/chaos.md"
