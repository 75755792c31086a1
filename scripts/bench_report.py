#!/usr/bin/python3
"""Turns scripts/bench.sh train's runs into <out>/train_bench.md and prints it.

Each run directory holds the trainer's metrics.jsonl: a "compute" line (GEMM
rate, BLAS, kernels, FLOPs per token), "train" lines (tokens/s, MFU per step),
a "memory" line (peak RSS) and a "cpu" line (CPU time a step of the trainer
and of each expert process over the timed steps, and the share of the cores
they kept busy). Steps 1-5 (warm-up) are left out; the median
of the rest is reported. Runs named <run>-r<k> are round k of a --rounds
bench: each row is then the round with the median tokens/s, and the ratios
the median of the rounds' own ratios (both runs of a ratio from one round,
so that a VM's drift between rounds cancels), every round's listed below.
"""
import argparse
import datetime
import json
import os
import platform
import re
import statistics
import sys


def load(run_dir):
    compute, memory, cpu, steps = None, None, None, []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            kind = rec.get("kind")
            if kind == "compute":
                compute = rec
            elif kind == "memory":
                memory = rec
            elif kind == "cpu":
                cpu = rec
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
        "cpu": cpu,
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


EXPERTS_LABEL = {
    "inprocess": "in process",
    "local": "4 processes",
    "serial": "4 processes, 1 micro-batch at a time",
}


def median_round(rounds):
    """The round whose tokens/s is the median (the lower middle of an even count)."""
    ordered = sorted(rounds.values(), key=lambda x: x["tok_s"])
    return ordered[(len(ordered) - 1) // 2]


def round_ratios(groups, num, den):
    """num's tokens/s over den's, for every round both ran."""
    if num not in groups or den not in groups:
        return []
    return [groups[num][k]["tok_s"] / groups[den][k]["tok_s"]
            for k in sorted(groups[num]) if k in groups[den]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("runs", nargs="+")
    args = ap.parse_args()
    groups = {}  # run -> {round: loaded}, in the order first run
    for name in args.runs:
        m = re.fullmatch(r"(.+?)(?:-r(\d+))?", name)
        groups.setdefault(m.group(1), {})[int(m.group(2) or 1)] = load(
            os.path.join(args.out, name))
    rounds = max(len(g) for g in groups.values())
    r = {name: median_round(g) for name, g in groups.items()}
    first = next(iter(r.values()))["compute"]
    rates = {}
    for g in groups.values():
        for x in g.values():
            rates.setdefault((x["compute"]["gemm_threads"], x["compute"].get("gemm_bf16", False)),
                             []).append(x["gemm"])
    cores = os.cpu_count()
    lines = [
        f"Measured {datetime.date.today().isoformat()} on {cpu_model()}, {cores} cores; "
        f"{first['blas']}, kernels '{first['kernels']}' ({first['kernels_source']}); "
        "MFU is against the GEMM rate each run measures at its start on the cores it uses "
        "(its threads in process; all cores with expert processes): "
        + "; ".join(
            f"{t} thread{'s' if t > 1 else ''}{' (bf16 operands)' if bf16 else ''} "
            f"{min(g):.0f}-{max(g):.0f} GFLOP/s"
            for (t, bf16), g in sorted(rates.items())) + "."
        + (f" {rounds} rounds round-robin: each row is the round with the median tokens/s, "
           "each ratio the median of the rounds' own ratios." if rounds > 1 else ""),
        "",
        "| config | experts | threads | tokens/s | model GFLOP/s | MFU | remote / in-process "
        "| 2 / 1 threads | CPU a step, core-ms: coordinator + expert processes | cores busy "
        "| peak RSS coordinator | peak RSS per expert process |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    per_round = []
    for name, x in r.items():
        config, experts, threads = name.split("-")
        ratio = scale = ""
        if experts in ("local", "serial"):
            ratios = round_ratios(groups, name, f"{config}-inprocess-t0")
            if ratios:
                ratio = f"{statistics.median(ratios):.2f}"
                per_round.append(f"{config} {'one at a time ' if experts == 'serial' else ''}"
                                 "remote / in-process " + ", ".join(f"{v:.2f}" for v in ratios))
        if experts == "inprocess" and threads == "t0":
            scales = round_ratios(groups, name, f"{config}-inprocess-t1")
            if scales:
                scale = f"{statistics.median(scales):.2f}"
                per_round.append(f"{config} 2 / 1 threads " +
                                 ", ".join(f"{v:.2f}" for v in scales))
        experts_rss = x["memory"]["expert_peak_rss_mib"]
        cpu = x["cpu"]
        cpu_ms = busy = ""
        if cpu:
            coordinator = cpu["coordinator_core_ms_per_step"]
            expert_ms = sum(cpu["expert_core_ms_per_step"])
            cpu_ms = f"{coordinator:.0f}"
            if cpu["expert_core_ms_per_step"]:
                cpu_ms += f" + {expert_ms:.0f} = {coordinator + expert_ms:.0f}"
            busy = f"{100 * cpu['used_fraction']:.0f}% of {cpu['cores']}"
        lines.append(
            f"| {config} | {EXPERTS_LABEL[experts]} "
            f"| {x['compute']['threads']} | {x['tok_s']:.0f} | {x['gflops']:.1f} "
            f"| {100 * x['mfu']:.0f}% | {ratio} | {scale} | {cpu_ms} | {busy} "
            f"| {x['memory']['coordinator_peak_rss_mib']:.0f} MiB "
            f"| {(f'{max(experts_rss):.0f} MiB' if experts_rss else '')} |")
    if rounds > 1:
        lines += ["", "Every round (in order): " + "; ".join(per_round) + ". MFU per round: "
                  + "; ".join(f"{name} " + ", ".join(f"{100 * g[k]['mfu']:.0f}%"
                                                      for k in sorted(g))
                              for name, g in groups.items() if name.endswith("-t0")
                              and "inprocess" in name) + "."]
    for label, num, den in (
            ("accum2 (the released config, 2 micro-batches a step): 2 micro-batches at once / "
             "one at a time, 4 processes", "accum2-local-t0", "accum2-serial-t0"),
            ("bf16 (the released config, --matmul_dtype bfloat16): tokens/s against the float32 "
             "products in process", "bf16-inprocess-t0", "released-inprocess-t0")):
        ratios = round_ratios(groups, num, den)
        if ratios:
            lines += ["", f"{label}: {statistics.median(ratios):.2f}"
                      + (" (rounds " + ", ".join(f"{v:.2f}" for v in ratios) + ")"
                         if len(ratios) > 1 else "") + "."]
    if any(x["cpu"] for x in r.values()):
        lines += ["", "CPU a step: user + system time of each process over the timed steps, "
                  "from /proc (10 ms ticks), and the share of the cores all of them kept busy. "
                  "It counts OpenMP threads spinning while they wait for work (libgomp's "
                  "default), so in process on 2 threads the cores are busy nearly all the time; "
                  "in process on 1 thread it is the step's work alone."]
    lines += ["", "FLOPs per token (training, model FLOPs): " + ", ".join(
        f"{c} {r[f'{c}-inprocess-t0']['compute']['flops_per_token'] / 1e6:.2f} M"
        for c in ("released", "main") if f"{c}-inprocess-t0" in r) + "."]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "train_bench.md"), "w") as f:
        f.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
