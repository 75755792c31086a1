#!/usr/bin/python3
"""The data-parallel ranks bench's table (scripts/ranks_bench.sh) from its
results file.

  ranks_report.py RESULTS.tsv OUT.md STEPS

RESULTS.tsv lines: ranks, rate, round, the expert processes' CPU seconds over
the run, the run's out_dir (rank 0's metrics.jsonl there, rank 1's in
rank1/).
"""
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from link_report import machine_and_commit, write_doc  # noqa: E402

WARMUP = 5
CORES = os.cpu_count()
BITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bits(rate):
    for unit, scale in BITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    return None


def rank_figures(path):
    lines = [json.loads(l) for l in open(path)]
    train = [r for r in lines if r.get("kind") == "train"]
    timed = train[WARMUP:]
    if not timed:
        sys.exit(f"ranks_report: {path}: fewer than {WARMUP + 1} steps")
    cpu = next((r for r in lines if r.get("kind") == "cpu"), None)
    if cpu is None:
        sys.exit(f"ranks_report: {path}: no cpu line")
    med = lambda key: statistics.median(r.get(key, 0) for r in timed)
    return {"tps": med("tokens_per_s"), "step_s": med("seconds"), "tokens": timed[0]["tokens"],
            "steps": len(train), "allreduce_s": med("allreduce_s"),
            "allreduce_bytes": med("allreduce_bytes"),
            "core_ms": cpu["coordinator_core_ms_per_step"]}


def run_figures(ranks, expert_cpu_s, out_dir):
    paths = [os.path.join(out_dir, "metrics.jsonl")]
    if ranks > 1:
        paths += [os.path.join(out_dir, f"rank{r}", "metrics.jsonl") for r in range(1, ranks)]
    per_rank = [rank_figures(p) for p in paths]
    f = dict(per_rank[0])
    # Every process's CPU a step: the ranks' over their timed steps, the
    # expert processes' over the whole run.
    f["rank_core_ms"] = sum(r["core_ms"] for r in per_rank)
    f["expert_core_ms"] = 1000 * expert_cpu_s / f["steps"]
    f["core_ms"] = f["rank_core_ms"] + f["expert_core_ms"]
    f["allreduce_s"] = max(r["allreduce_s"] for r in per_rank)
    return f


def main():
    results, out_path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    runs = []
    for line in open(results):
        ranks, rate, rnd, expert_cpu, out_dir = line.rstrip("\n").split("\t")
        f = run_figures(int(ranks), float(expert_cpu), out_dir)
        f.update(ranks=int(ranks), rate=rate, round=rnd)
        runs.append(f)
    cpu, commit = machine_and_commit()
    text = [f"Measured {datetime.date.today()} on {cpu}, {CORES} cores, commit {commit}: "
            f"4 expert hosts and 2 rank hosts in network namespaces of this machine, the "
            f"released config (2048 tokens a step), {steps} steps a run, medians of the steps "
            f"after {WARMUP}, then over rounds. All-reduce: the slower rank's, from the end of "
            f"its backward (the wait for the other rank and the transfer); its link bound is "
            f"its bytes once each way at the rate (2 ranks: Gloo's ring sends each rank's "
            f"gradients once). CPU a step: every process, the ranks' over the timed steps, the "
            f"expert processes' over the run. CPU-bound limit: 2048 tokens x {CORES} cores / "
            f"the 1-rank step's core-seconds, in the same round.", "",
            "| link | ranks | tokens/s | / 1 rank | all-reduce a step, ms | share of the step "
            "| all-reduce link bound, ms | all-reduce MB | CPU a step, core-ms: ranks + experts "
            "| CPU-bound limit, tokens/s | / limit |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rate in dict.fromkeys(r["rate"] for r in runs):
        for ranks in sorted({r["ranks"] for r in runs}):
            rows = [r for r in runs if r["rate"] == rate and r["ranks"] == ranks]
            if not rows:
                continue
            speedups, limits, of_limit = [], [], []
            for r in rows:
                base = [b for b in runs if b["rate"] == rate and b["ranks"] == 1
                        and b["round"] == r["round"]]
                if not base:
                    continue
                speedups.append(r["tps"] / base[0]["tps"])
                limit = base[0]["tokens"] * CORES / (base[0]["core_ms"] / 1000)
                limits.append(limit)
                of_limit.append(r["tps"] / limit)
            med = lambda k: statistics.median(r[k] for r in rows)
            bits = rate_bits(rate)
            ar_ms = 1000 * med("allreduce_s")
            ar_mb = med("allreduce_bytes") / 1e6
            bound = f"{1000 * med('allreduce_bytes') * 8 / bits:.1f}" if bits and ranks > 1 else "-"
            m = lambda xs: statistics.median(xs) if xs else float("nan")
            cpu = (f"{med('core_ms'):.0f}: {med('rank_core_ms'):.0f} + "
                   f"{med('expert_core_ms'):.0f}")
            text.append(
                f"| {rate} | {ranks} | {med('tps'):.0f} | {m(speedups):.2f} | "
                f"{ar_ms:.1f} | {ar_ms / (1000 * med('step_s')):.1%} | {bound} | "
                f"{ar_mb:.2f} | {cpu} | {m(limits):.0f} | {m(of_limit):.2f} |"
                if ranks > 1 else
                f"| {rate} | 1 | {med('tps'):.0f} | 1.00 | - | - | - | - | "
                f"{cpu} | {m(limits):.0f} | {m(of_limit):.2f} |")
    write_doc(text, out_path)


if __name__ == "__main__":
    main()
