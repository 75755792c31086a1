#!/usr/bin/python3
"""Turns scripts/bench.sh train's runs into <out>/train_bench.md and prints it.

Each run directory holds the trainer's metrics.jsonl: a "compute" line (GEMM
rate, BLAS, kernels, FLOPs per token), "train" lines (tokens/s, MFU per step)
and a "memory" line (peak RSS). Steps 1-5 (warm-up) are left out; the median
of the rest is reported.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys


def load(run_dir):
    compute, memory, steps = None, None, []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            kind = rec.get("kind")
            if kind == "compute":
                compute = rec
            elif kind == "memory":
                memory = rec
            elif kind == "train":
                steps.append(rec)
    if compute is None or memory is None or len(steps) <= 5:
        raise SystemExit(f"{run_dir}: incomplete run (compute/memory line or steps missing)")
    timed = steps[5:]
    return {
        "tok_s": statistics.median(s["tokens_per_s"] for s in timed),
        "gflops": statistics.median(s["gflops"] for s in timed),
        "mfu": statistics.median(s["mfu"] for s in timed),
        "gemm": compute["gemm_gflops"],
        "compute": compute,
        "memory": memory,
        "steps": len(steps),
    }


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args()
    r = {name: load(os.path.join(args.out, name)) for name in args.runs}
    first = r[args.runs[0]]["compute"]
    rates = {}
    for x in r.values():
        rates.setdefault(x["compute"]["gemm_threads"], []).append(x["gemm"])
    cores = os.cpu_count()
    lines = [
        f"Measured {datetime.date.today().isoformat()} on {cpu_model()}, {cores} cores; "
        f"{first['blas']}, kernels '{first['kernels']}' ({first['kernels_source']}); "
        "MFU is against the GEMM rate each run measures at its start on the cores it uses "
        "(its threads in process; all cores with expert processes): "
        + "; ".join(
            f"{t} thread{'s' if t > 1 else ''} {min(g):.0f}-{max(g):.0f} GFLOP/s"
            for t, g in sorted(rates.items())) + ".",
        "",
        "| config | experts | threads | tokens/s | model GFLOP/s | MFU | remote / in-process "
        "| 2 / 1 threads | peak RSS coordinator | peak RSS per expert process |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in args.runs:
        config, experts, threads = name.split("-")
        x = r[name]
        ratio = scale = ""
        if experts == "local":
            base = r.get(f"{config}-inprocess-t0")
            if base:
                ratio = f"{x['tok_s'] / base['tok_s']:.2f}"
        if experts == "inprocess" and threads == "t0":
            one = r.get(f"{config}-inprocess-t1")
            if one:
                scale = f"{x['tok_s'] / one['tok_s']:.2f}"
        experts_rss = x["memory"]["expert_peak_rss_mib"]
        lines.append(
            f"| {config} | {'4 processes' if experts == 'local' else 'in process'} "
            f"| {x['compute']['threads']} | {x['tok_s']:.0f} | {x['gflops']:.1f} "
            f"| {100 * x['mfu']:.0f}% | {ratio} | {scale} "
            f"| {x['memory']['coordinator_peak_rss_mib']:.0f} MiB "
            f"| {(f'{max(experts_rss):.0f} MiB' if experts_rss else '')} |")
    lines += ["", "FLOPs per token (training, model FLOPs): " + ", ".join(
        f"{c} {r[f'{c}-inprocess-t0']['compute']['flops_per_token'] / 1e6:.2f} M"
        for c in ("released", "main") if f"{c}-inprocess-t0" in r) + "."]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "train_bench.md"), "w") as f:
        f.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
