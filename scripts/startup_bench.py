#!/usr/bin/python3
"""Start-up time of the serving processes (start-up is most of the recovery
time after a crash). Times, from spawn to the port file (the moment
the process serves), --reps times each:

  * one himoe-expert with an empty BLIS kernel cache (it probes the kernel
    sets on CPUs BLIS does not know), with the cache the previous start
    wrote, and with --blas_probe=false (the floor: no probe at all);
  * himoe-cluster on the shipped 4-group cluster file (4 himoe-expert and a
    himoe-router on free ports) with an empty and with a warm cache, to its
    ready line.

Each himoe-expert's own log splits its time ("ready 0.35 s after exec:
libraries 0.33 s, compute set-up 0.02 s, ..."); the table gives the median of
each phase. Writes Markdown to --out.

  /usr/bin/python3 scripts/startup_bench.py --build build --out runs/bench/startup.md
"""
import argparse
import datetime
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loopback_ports import free_ports  # noqa: E402
from proc_util import stop_processes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERT_FLAGS = ["--group_id=0", "--num_groups=4", "--num_experts=8", "--num_layers=2",
                "--d_model=256", "--d_ff=1024", "--threads=1"]


def wait_for(predicate, proc, what, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            sys.exit(f"startup bench: {proc.args[0]} exited with {proc.returncode} before {what}")
        time.sleep(0.002)
    sys.exit(f"startup bench: no {what} after {timeout} s")


def phases(log_text):
    m = re.search(r"ready [0-9.]+ s after exec: (.*)", log_text)
    if not m:
        return {}
    return {name: float(sec)
            for name, sec in re.findall(r"(?:^|, )([a-z][a-z -]*?) ([0-9.]+) s", m.group(1))}


def kernels(log_text):
    m = re.search(r"kernels '([a-z0-9]+)' \(([a-zA-Z_]+)\)", log_text)
    return f"{m.group(1)} ({m.group(2)})" if m else "n/a"


def time_expert(build, work, cache_dir, extra):
    port_file = os.path.join(work, "expert.port")
    if os.path.exists(port_file):
        os.remove(port_file)
    log_path = os.path.join(work, "expert.log")
    env = dict(os.environ, HIMOE_CACHE_DIR=cache_dir)
    env.pop("BLIS_ARCH_TYPE", None)
    with open(log_path, "w") as log:
        start = time.monotonic()
        proc = subprocess.Popen([os.path.join(build, "expert_service", "himoe-expert"),
                                 "--address=127.0.0.1:0", f"--port_file={port_file}"] +
                                EXPERT_FLAGS + extra, stdout=log, stderr=subprocess.STDOUT,
                                env=env)
        wait_for(lambda: os.path.exists(port_file) and os.path.getsize(port_file) > 0, proc,
                 "port file")
        seconds = time.monotonic() - start
    stop_processes([proc], grace_s=30)
    text = open(log_path).read()
    return seconds, phases(text), kernels(text)


def time_cluster(build, work, cache_dir):
    ports = free_ports(5)
    text = open(os.path.join(ROOT, "deploy", "local", "cluster.textproto")).read()
    for old, new in zip(["50061", "50062", "50063", "50064", "50051"], ports):
        text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
    text = re.sub(r"metrics_port: [0-9]+", "metrics_port: 0", text)
    cluster = os.path.join(work, "cluster.textproto")
    with open(cluster, "w") as f:
        f.write(text)
    out_path = os.path.join(work, "cluster.out")
    env = dict(os.environ, HIMOE_CACHE_DIR=cache_dir)
    env.pop("BLIS_ARCH_TYPE", None)
    logs = os.path.join(work, "cluster-logs")
    shutil.rmtree(logs, ignore_errors=True)
    with open(out_path, "w") as out:
        start = time.monotonic()
        proc = subprocess.Popen([os.path.join(build, "deploy", "local", "himoe-cluster"),
                                 f"--cluster={cluster}", f"--log_dir={logs}"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
        wait_for(lambda: "himoe-cluster: ready" in open(out_path).read(), proc, "ready line")
        seconds = time.monotonic() - start
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    return seconds, kernels(open(os.path.join(logs, "expert-0.log")).read())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench", "startup.md"))
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="himoe-startup-")
    try:
        rows = []
        for name, warm, extra in [("himoe-expert, empty kernel cache", False, []),
                                  ("himoe-expert, cached kernel choice", True, []),
                                  ("himoe-expert, --blas_probe=false", False,
                                   ["--blas_probe=false"])]:
            cache = os.path.join(work, "cache")
            runs = []
            if warm:
                shutil.rmtree(cache, ignore_errors=True)
                time_expert(args.build, work, cache, [])  # writes the cache
            for _ in range(args.reps):
                if not warm:
                    shutil.rmtree(cache, ignore_errors=True)
                runs.append(time_expert(args.build, work, cache, extra))
                print(f"startup bench: {name}: {runs[-1][0]:.3f} s", file=sys.stderr)
            names = list(runs[0][1].keys())
            split = ", ".join(f"{p} {statistics.median(r[1].get(p, 0) for r in runs):.2f}"
                              for p in names)
            rows.append((name, statistics.median(r[0] for r in runs), split, runs[0][2]))
        for name, warm in [("himoe-cluster (4 groups + router), empty cache", False),
                           ("himoe-cluster (4 groups + router), warm cache", True)]:
            cache = os.path.join(work, "cache")
            runs = []
            for _ in range(args.reps):
                if not warm:
                    shutil.rmtree(cache, ignore_errors=True)
                runs.append(time_cluster(args.build, work, cache))
                print(f"startup bench: {name}: {runs[-1][0]:.3f} s", file=sys.stderr)
            rows.append((name, statistics.median(r[0] for r in runs), "", runs[0][1]))
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                    if l.startswith("model name")), platform.processor())
        lines = [f"Start-up, {datetime.date.today()}, {cpu}, {os.cpu_count()} cores "
                 f"(`bash scripts/bench.sh startup`, median of {args.reps}):", "",
                 "| process | spawn to serving (s) | vs. empty cache | phases, from its log (s) "
                 "| BLIS kernels |", "|---|---|---|---|---|"]
        base = {"himoe-expert": rows[0][1], "himoe-cluster": rows[3][1]}
        for name, seconds, split, kern in rows:
            ratio = seconds / base[name.split(",")[0].split(" (")[0]]
            lines.append(f"| {name} | {seconds:.2f} | {ratio:.2f} | {split or '-'} | {kern} |")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print("\n".join(lines))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
