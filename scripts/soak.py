#!/usr/bin/python3
"""A soak of the serving cluster: bounded concurrent RouteForward load for
--seconds, one expert group killed (SIGKILL) at a third of it and started
again on its address --down seconds later. Reports errors by status code,
p50/p99 latency of successful calls (before the kill, and overall), the
recovery time (restart to the first success, and kill to it), and the RSS of
every process at start and end, as Markdown (--out). Needs /usr/bin/python3
with Debian's python3-grpcio, python3-grpc-tools and python3-numpy.

  /usr/bin/python3 scripts/soak.py --build build --out runs/bench/soak.md
"""
import argparse
import collections
import datetime
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostinfo  # noqa: E402
from proc_util import stop_processes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stubs(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I" + os.path.join(ROOT, "proto"),
                    "--python_out=" + out_dir, "--grpc_python_out=" + out_dir] +
                   [os.path.join(ROOT, "proto", "himoe", "v1", p)
                    for p in ("tensor.proto", "router.proto")], check=True)
    sys.path.insert(0, out_dir)
    from himoe.v1 import router_pb2, router_pb2_grpc, tensor_pb2  # noqa: E402
    return router_pb2, router_pb2_grpc, tensor_pb2


def wait_port_file(path, proc, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            return int(open(path).read().split()[0])
        if proc.poll() is not None:
            sys.exit(f"soak: {proc.args[0]} exited with {proc.returncode} before serving")
        time.sleep(0.05)
    sys.exit(f"soak: no port file {path} after {timeout} s")


def rss_mib(pid):
    m = hostinfo.rss_mib(pid)
    return float("nan") if m is None else m


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench", "soak.md"))
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--down", type=float, default=5, help="seconds the killed group stays down")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rate", type=float, default=100, help="offered requests/s, all clients")
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()

    work = tempfile.mkdtemp(prefix="himoe-soak-")
    router_pb2, router_pb2_grpc, tensor_pb2 = stubs(os.path.join(work, "gen"))
    expert_bin = os.path.join(a.build, "expert_service", "himoe-expert")
    router_bin = os.path.join(a.build, "router_service", "himoe-router")
    groups, d = 4, 64
    model = ["--num_groups=4", "--num_experts=8", "--num_layers=2", f"--d_model={d}",
             "--d_ff=256", "--seed=1", "--threads=1", "--metrics_port=-1"]
    procs, ports = {}, {}

    def start_expert(g, port=0):
        pf = os.path.join(work, f"expert{g}.port")
        if os.path.exists(pf):
            os.remove(pf)
        log = open(os.path.join(work, f"expert{g}.log"), "a")
        p = subprocess.Popen([expert_bin, f"--address=127.0.0.1:{port}", f"--group_id={g}",
                              f"--port_file={pf}"] + model, stdout=log, stderr=log)
        procs[f"expert {g}"] = p
        ports[g] = wait_port_file(pf, p)

    try:
        for g in range(groups):
            start_expert(g)
        cluster = os.path.join(work, "cluster.textproto")
        with open(cluster, "w") as f:
            f.write(f"model {{ num_layers: 2 d_model: {d} d_ff: 256 num_experts: 8 "
                    "num_groups: 4 top_k: 1 seed: 1 }\nrouting { method: \"himoe\" }\n")
            for g in range(groups):
                f.write(f"groups {{ address: \"127.0.0.1:{ports[g]}\" }}\n")
            f.write("router { address: \"127.0.0.1:0\" deadline_ms: 2000 }\n")
        rpf = os.path.join(work, "router.port")
        rlog = open(os.path.join(work, "router.log"), "w")
        procs["router"] = subprocess.Popen(
            [router_bin, f"--cluster={cluster}", "--address=127.0.0.1:0", "--threads=1",
             f"--port_file={rpf}", "--metrics_port=-1"], stdout=rlog, stderr=rlog)
        router_port = wait_port_file(rpf, procs["router"])
        stub = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(f"127.0.0.1:{router_port}"))
        x = np.random.default_rng(0).standard_normal((a.tokens, d)).astype(np.float32)
        request = router_pb2.RouteForwardRequest(layer=0, hidden=tensor_pb2.Tensor(
            dtype=tensor_pb2.DTYPE_FLOAT32, shape=list(x.shape), data=x.tobytes()))
        stub.RouteForward(request, timeout=30)  # warm
        time.sleep(1)
        rss_start = {name: rss_mib(p.pid) for name, p in procs.items()}

        results = []  # (start time, latency s, code name)
        lock = threading.Lock()
        t0 = time.time()
        end = t0 + a.seconds
        interval = a.clients / a.rate

        def client(i):
            nxt = t0 + interval * i / a.clients
            while True:
                now = time.time()
                if now >= end:
                    return
                if now < nxt:
                    time.sleep(nxt - now)
                nxt += interval
                s = time.time()
                try:
                    stub.RouteForward(request, timeout=2.0)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                with lock:
                    results.append((s - t0, time.time() - s, code))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
        for t in threads:
            t.start()
        time.sleep(a.seconds / 3)
        victim = 1
        kill_t = time.time() - t0
        os.kill(procs[f"expert {victim}"].pid, signal.SIGKILL)
        procs[f"expert {victim}"].wait()
        time.sleep(a.down)
        restart_t = time.time() - t0
        start_expert(victim, ports[victim])
        serving_t = time.time() - t0
        for t in threads:
            t.join()
        rss_end = {name: rss_mib(p.pid) for name, p in procs.items()}
    finally:
        stop_processes(procs.values(), grace_s=10)

    codes = collections.Counter(c for _, _, c in results)
    ok_all = sorted(l for _, l, c in results if c == "OK")
    ok_before = sorted(l for s, l, c in results if c == "OK" and s < kill_t)
    first_ok = min((s + l for s, l, c in results if c == "OK" and s >= restart_t), default=None)
    last_fail = max((s + l for s, l, c in results if c != "OK"), default=None)
    pct = lambda v, q: 1000 * v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")
    cpu = hostinfo.cpu_model()
    md = [f"Soak measured {datetime.date.today()} on {cpu}, {os.cpu_count()} cores, "
          f"{platform.system()}: {a.clients} clients offering {a.rate:g} RouteForward/s of "
          f"{a.tokens} tokens (d_model {d}, 4 groups, 1 thread each, router deadline 2 s) for "
          f"{a.seconds:g} s; expert group 1 killed (SIGKILL) at {kill_t:.1f} s, started again "
          f"on its address at {restart_t:.1f} s (serving at {serving_t:.1f} s).", "",
          "| calls | " + " | ".join(sorted(codes)) + " |",
          "|---|" + "---|" * len(codes),
          f"| {len(results)} | " + " | ".join(str(codes[c]) for c in sorted(codes)) + " |", "",
          "| latency of OK calls | p50 ms | p99 ms |", "|---|---|---|",
          f"| before the kill | {pct(ok_before, 0.5):.1f} | {pct(ok_before, 0.99):.1f} |",
          f"| whole run | {pct(ok_all, 0.5):.1f} | {pct(ok_all, 0.99):.1f} |", ""]
    if first_ok is not None:
        md.append(f"Recovery: first OK call {first_ok - restart_t:.2f} s after the restart "
                  f"({first_ok - serving_t:.2f} s after the group served again, "
                  f"{first_ok - kill_t:.2f} s after the kill); last failed call ended at "
                  f"{(last_fail or 0):.1f} s.")
    else:
        md.append("Recovery: no OK call after the restart.")
    md += ["", "| process | RSS at start MiB | RSS at end MiB |", "|---|---|---|"]
    for name in rss_start:
        note = " (restarted)" if name == "expert 1" else ""
        md.append(f"| {name}{note} | {rss_start[name]:.0f} | {rss_end.get(name, float('nan')):.0f} |")
    text = "\n".join(md) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    print(text)
    return 0 if first_ok is not None else 1


if __name__ == "__main__":
    sys.exit(main())
