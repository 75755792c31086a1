#!/usr/bin/python3
"""The groups bench's tables (scripts/groups_bench.sh) from its results file.

  groups_report.py RESULTS.tsv OUT.md STEPS

RESULTS.tsv lines: "method", method, rate, round, metrics.jsonl; or "scale",
M, "none", round, metrics.jsonl.
"""
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from link_report import machine_and_commit, write_doc  # noqa: E402

WARMUP = 5


def figures(path):
    lines = [json.loads(l) for l in open(path)]
    timed = [r for r in lines if r.get("kind") == "train"][WARMUP:]
    if not timed:
        sys.exit(f"groups_report: {path}: fewer than {WARMUP + 1} steps")
    cpu = next((r for r in lines if r.get("kind") == "cpu"), {})
    med = lambda key: statistics.median(r.get(key, 0) for r in timed)
    return {"tps": med("tokens_per_s"), "step_ms": 1000 * med("seconds"),
            "wait_ms": 1000 * med("forward_wait_s"),
            "straggler_ms": 1000 * med("forward_straggler_s"),
            "calls": med("forward_calls"),
            "coordinator_ms": cpu.get("coordinator_core_ms_per_step", float("nan"))}


def main():
    results, out_path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    runs = []
    for line in open(results):
        kind, key, rate, rnd, path = line.rstrip("\n").split("\t")
        f = figures(path)
        f.update(kind=kind, key=key, rate=rate, round=rnd)
        runs.append(f)
    cpu, commit = machine_and_commit()
    med = lambda rows, k: statistics.median(r[k] for r in rows)
    text = [f"Measured {datetime.date.today()} on {cpu}, {os.cpu_count()} cores, commit "
            f"{commit}: the expert groups on hosts in network namespaces of this "
            f"machine, one himoe-expert each; {steps} steps a run, medians of the steps after "
            f"{WARMUP}, then over rounds.", ""]
    methods = [r for r in runs if r["kind"] == "method"]
    if methods:
        text += ["Grouped against flat dispatch, released config (2 micro-batches of 8 x 128 "
                 "a step). Forward wait: a step's sum over Forward calls of the wait for the "
                 "slowest group; straggler: that minus the mean group's wait.", "",
                 "| link | method | tokens/s | step, ms | Forward wait a step, ms | "
                 "straggler a step, ms | straggler / wait | / vanilla tokens/s |",
                 "|---|---|---:|---:|---:|---:|---:|---:|"]
        for rate in dict.fromkeys(r["rate"] for r in methods):
            for method in dict.fromkeys(r["key"] for r in methods):
                rows = [r for r in methods if r["rate"] == rate and r["key"] == method]
                ratios = []
                for r in rows:
                    base = [b for b in methods if b["rate"] == rate and b["key"] == "vanilla"
                            and b["round"] == r["round"]]
                    if base:
                        ratios.append(r["tps"] / base[0]["tps"])
                wait, strag = med(rows, "wait_ms"), med(rows, "straggler_ms")
                text.append(f"| {rate} | {method} | {med(rows, 'tps'):.0f} | "
                            f"{med(rows, 'step_ms'):.0f} | {wait:.1f} | {strag:.1f} | "
                            f"{strag / wait if wait else 0:.2f} | "
                            f"{statistics.median(ratios) if ratios else float('nan'):.2f} |")
    scale = [r for r in runs if r["kind"] == "scale"]
    if scale:
        if methods:
            text.append("")
        text += ["Scaling in groups: M hosts, N = 2M experts, k 1, 2 layers, d 64, width "
                 "128, 1024 tokens a step (16 x 64), unshaped links. Coordinator CPU: user + system "
                 "core-ms a step over the timed steps.", "",
                 "| M | tokens/s | step, ms | coordinator CPU a step, core-ms | "
                 "coordinator CPU per group, core-ms | Forward wait a step, ms |",
                 "|---:|---:|---:|---:|---:|---:|"]
        for m in sorted({r["key"] for r in scale}, key=int):
            rows = [r for r in scale if r["key"] == m]
            c = med(rows, "coordinator_ms")
            text.append(f"| {m} | {med(rows, 'tps'):.0f} | {med(rows, 'step_ms'):.0f} | "
                        f"{c:.0f} | {c / int(m):.1f} | {med(rows, 'wait_ms'):.1f} |")
    write_doc(text, out_path)


if __name__ == "__main__":
    main()
