#!/usr/bin/python3
"""The link bench's tables (scripts/link_bench.sh) from its results file.

  link_report.py RESULTS.tsv OUT.md STEPS MICRO_BATCHES [GENERATE.tsv]

RESULTS.tsv lines: config, overlap ("off", "on", or "onN": N micro-batches
in flight), rate, wire dtype, rtt, round, eth0 tx bytes, eth0 rx bytes, the
run's metrics.jsonl. GENERATE.tsv lines: rtt, round,
ms a token of one Generate stream. Exits 1 when a run's row bytes
differ from tokens x distinct groups a token x d_model x bytes x 2.
"""
import datetime
import json
import os
import statistics
import subprocess
import sys

D_MODEL = 128
WARMUP = 5
BYTES = {"float32": 4, "bfloat16": 2}
UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def rate_bps(rate):
    for unit, scale in UNITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    return None  # "none": unshaped


def machine_and_commit():
    """This machine's CPU model name and the checkout's short commit."""
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), "?")
    commit = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse",
                             "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return cpu, commit or "?"


def write_doc(lines, path):
    """Prints the table's lines and writes them to `path`."""
    doc = "\n".join(lines) + "\n"
    print(doc)
    with open(path, "w") as f:
        f.write(doc)


def schedule(overlap, micro):
    """(overlap, micro-batches) of an overlap label."""
    if overlap in ("on", "off"):
        return overlap, micro
    return "on", overlap[2:]


def run_figures(path, wire):
    train = [json.loads(l) for l in open(path) if '"kind":"train"' in l]
    timed = train[WARMUP:]
    if not timed:
        sys.exit(f"link_report: {path}: fewer than {WARMUP + 1} steps")
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    sent = statistics.median(r["row_bytes_sent"] for r in timed)
    received = statistics.median(r["row_bytes_received"] for r in timed)
    for r in train:
        # Forward and Backward each move a row per token and group it reaches.
        want = 2 * r["tokens"] * sum(l["groups_per_token"] for l in r["layers"]) * D_MODEL
        want = round(want) * BYTES[wire]
        if r["row_bytes_sent"] != want or r["row_bytes_received"] != want:
            sys.exit(f"link_report: {path}, step {r['step']}: row bytes sent "
                     f"{r['row_bytes_sent']}, received {r['row_bytes_received']}; the formula "
                     f"(tokens x distinct groups a token x d_model x bytes x 2) gives {want}")
    return {"tps": tps, "sent": sent, "received": received, "tokens": timed[0]["tokens"]}


def main():
    results, out_path, steps, micro = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    runs = []
    for line in open(results):
        config, overlap, rate, wire, rtt, rnd, tx, rx, path = line.rstrip("\n").split("\t")
        f = run_figures(path, wire)
        f.update(config=config, overlap=overlap, rate=rate, wire=wire, rtt=rtt, round=rnd,
                 eth0_tx=int(tx) / steps, eth0_rx=int(rx) / steps)
        runs.append(f)

    cpu, commit = machine_and_commit()
    mib = 2 ** 20
    text = [f"Measured {datetime.date.today()} on {cpu}, {os.cpu_count()} cores, commit "
            f"{commit}: 4 himoe-expert hosts and the coordinator in network namespaces of "
            f"this machine, {steps} steps a run, 2048 tokens a step (a batch of 16 x 128 as "
            f"micro-batches; overlap on: all in flight at once, off: one at a time). tokens/s: "
            "the median step after 5, the median over rounds (each ratio "
            "the median of the rounds' own). Link bound: tokens/s if moving the step's row "
            "bytes (the larger direction) at the tbf rate were the only cost. Row bytes: what "
            "the transport moved a step each way, equal to tokens x distinct groups a token x "
            "d_model x bytes x 2 in every run (checked). eth0: everything through the "
            "coordinator's interface over the run, a step (framing, start-up, evaluation).", ""]

    def same(**kw):
        return [x for x in runs if all(x[k] == v for k, v in kw.items())]

    shaped = [r for r in runs if r["rtt"] == "-"]
    text += ["| config | overlap | micro-batches | link | wire | tokens/s | / unshaped "
             "| link bound tokens/s | / min(unshaped, bound) | row MiB a step, each way "
             "| eth0 MiB a step, out / in |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    keys = []
    for r in shaped:
        k = (r["config"], r["overlap"], r["rate"], r["wire"])
        if k not in keys:
            keys.append(k)
    for config, overlap, rate, wire in keys:
        rounds = same(config=config, overlap=overlap, rate=rate, wire=wire, rtt="-")
        per_round, per_round_min, bounds = [], [], []
        for r in rounds:
            base = same(config=config, overlap=overlap, rate="none", wire=wire, rtt="-",
                        round=r["round"])
            bps = rate_bps(rate)
            bound = (r["tokens"] / (max(r["sent"], r["received"]) * 8 / bps)) if bps else None
            if bound:
                bounds.append(bound)
            if base:
                per_round.append(r["tps"] / base[0]["tps"])
                limit = min(base[0]["tps"], bound) if bound else base[0]["tps"]
                per_round_min.append(r["tps"] / limit)
        tps = statistics.median(r["tps"] for r in rounds)
        cell = lambda v, f: (f % statistics.median(v)) if v else ""
        text.append(
            f"| {config} | {' | '.join(schedule(overlap, micro))} | {rate} | {wire} | {tps:.0f} | "
            f"{cell(per_round, '%.2f')} | "
            f"{cell(bounds, '%.0f')} | {cell(per_round_min, '%.2f')} | "
            f"{rounds[0]['sent'] / mib:.1f} | "
            f"{statistics.median(r['eth0_tx'] for r in rounds) / mib:.1f} / "
            f"{statistics.median(r['eth0_rx'] for r in rounds) / mib:.1f} |")

    relayed = [r for r in runs if r["rtt"] != "-"]
    if relayed:
        rtts = sorted({r["rtt"] for r in relayed}, key=float)
        generate = {}
        if len(sys.argv) > 5 and os.path.exists(sys.argv[5]):
            for line in open(sys.argv[5]):
                rtt, rnd, ms = line.split()
                generate.setdefault(rtt, []).append(float(ms))
        text += ["", "Latency: the links unshaped, a delay relay (scripts/delay_relay.py) in "
                 "front of every group adding the round-trip time; training on the released "
                 "config, float32; Generate: one stream through himoe-router serving that "
                 "config (64 new tokens, the median of 3 streams a round, then over rounds).",
                 "", f"| RTT added, ms | overlap | micro-batches | tokens/s | step, ms "
                 f"| / {rtts[0]} ms | Generate, ms a token |", "|---:|---|---:|---:|---:|---:|---:|"]
        for overlap in sorted({r["overlap"] for r in relayed}):
            for rtt in rtts:
                rounds = same(rtt=rtt, overlap=overlap)
                ratios = [r["tps"] / same(rtt=rtts[0], overlap=overlap, round=r["round"])[0]["tps"]
                          for r in rounds]
                tps = statistics.median(r["tps"] for r in rounds)
                gen = f"{statistics.median(generate[rtt]):.2f}" if rtt in generate else ""
                text.append(f"| {rtt} | {' | '.join(schedule(overlap, micro))} | {tps:.0f} | "
                            f"{1000 * rounds[0]['tokens'] / tps:.0f} | "
                            f"{statistics.median(ratios):.2f} | {gen} |")
    write_doc(text, out_path)


if __name__ == "__main__":
    main()
