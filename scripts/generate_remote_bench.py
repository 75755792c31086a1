#!/usr/bin/python3
"""Generate through remote experts, from an outside grpcio client, on the
cluster file's model (2 layers, d 256, 8 experts in 4 groups, a block of
--block_size tokens) served by himoe-router --checkpoint on 4 himoe-expert
processes, all on this host. The checkpoint is the trainer's after
--train_steps steps on those processes (throughput does not depend on
training). Measures, alternating --reps times:
  * 1 stream against --streams concurrent streams (16-byte prompt);
  * the KV cache against full recompute (a second himoe-router with
    --kv_cache=false on the same experts): 1 stream, a --kv_prompt-byte
    prompt and --kv_new_tokens new tokens (contexts 192-255 by default),
    and whether both sampled the same tokens;
  * for every 1- and N-stream run, the CPU per generated token of the 4
    experts, the router and this client (/proc/PID/stat, user + system)
    and the share of the cores left idle.
Writes Markdown tables (--out). Needs /usr/bin/python3 with Debian's
python3-grpcio and python3-grpc-tools.

  /usr/bin/python3 scripts/generate_remote_bench.py --build build \
      --out runs/bench/generate_remote.md
"""
import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proc_util import stop_processes  # noqa: E402
from soak import ROOT, stubs, wait_port_file  # noqa: E402

PROMPT = b"The fortune says"  # 16 bytes, as generate_bench.cc's shortest contexts


def cpu_seconds(pid):
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median(values):
    """The middle value (the upper one of an even count)."""
    v = sorted(values)
    return v[len(v) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench", "generate_remote.md"))
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5,
                    help="1- and N-stream runs (and KV / recompute pairs), alternating; the "
                         "tables give each rep and the median ratio (a single rep's ratio "
                         "moves widely within one run: docs/benchmarks.md)")
    ap.add_argument("--train_steps", type=int, default=20)
    ap.add_argument("--block_size", type=int, default=256)
    ap.add_argument("--kv_prompt", type=int, default=192)
    ap.add_argument("--kv_new_tokens", type=int, default=64)
    ap.add_argument("--shared_memory", type=int, default=1,
                    help="1: the router's rows to the groups through POSIX shared memory "
                         "(router.shared_memory, as deploy/local/cluster.textproto), 0: in "
                         "the gRPC messages")
    a = ap.parse_args()

    work = tempfile.mkdtemp(prefix="himoe-generate-")
    router_pb2, router_pb2_grpc, _ = stubs(os.path.join(work, "gen"))
    model = ["--num_groups=4", "--num_experts=8", "--num_layers=2", "--d_model=256",
             "--d_ff=1024", "--seed=1", "--threads=1", "--metrics_port=-1"]
    if a.shared_memory:
        model.append("--shared_memory")
    procs = []
    try:
        ports = []
        for g in range(4):
            pf = os.path.join(work, f"expert{g}.port")
            log = open(os.path.join(work, f"expert{g}.log"), "w")
            procs.append(subprocess.Popen(
                [os.path.join(a.build, "expert_service", "himoe-expert"),
                 "--address=127.0.0.1:0", f"--group_id={g}", f"--port_file={pf}"] + model,
                stdout=log, stderr=log))
            ports.append(wait_port_file(pf, procs[-1]))
        cluster = os.path.join(work, "cluster.textproto")
        with open(cluster, "w") as f:
            f.write("model { num_layers: 2 d_model: 256 d_ff: 1024 num_experts: 8 "
                    "num_groups: 4 top_k: 1 seed: 1 }\nrouting { method: \"himoe\" }\n")
            for p in ports:
                f.write(f"groups {{ address: \"127.0.0.1:{p}\" }}\n")
            f.write(f"router {{ shared_memory: {'true' if a.shared_memory else 'false'} }}\n")
        served = os.path.join(work, "served")
        with open(os.path.join(work, "train.log"), "w") as log:
            subprocess.run(
                [os.path.join(a.build, "trainer", "himoe-trainer"), "--experts=cluster",
                 f"--cluster={cluster}", "--n_layer=2", f"--steps={a.train_steps}",
                 f"--checkpoint_every={a.train_steps}", "--eval_every=1000000",
                 f"--block_size={a.block_size}", "--threads=1", "--metrics_port=-1",
                 f"--out_dir={served}"],
                stdout=log, stderr=log, check=True)
        def start_router(name, extra):
            pf = os.path.join(work, f"{name}.port")
            log = open(os.path.join(work, f"{name}.log"), "w")
            procs.append(subprocess.Popen(
                [os.path.join(a.build, "router_service", "himoe-router"), f"--cluster={cluster}",
                 "--address=127.0.0.1:0", "--threads=1", f"--port_file={pf}",
                 "--metrics_port=-1", f"--checkpoint={os.path.join(served, 'checkpoints')}"]
                + extra, stdout=log, stderr=log))
            port = wait_port_file(pf, procs[-1])
            return router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))

        stub = start_router("router", [])
        kv_router = procs[-1]
        # The experts already hold the checkpoint's weights (the first router pushed them).
        recompute_stub = start_router("router_recompute",
                                      ["--kv_cache=false", "--load_expert_state=false"])
        kv_prompt = bytes(32 + (i * 7) % 90 for i in range(a.kv_prompt))

        def tokens(s, prompt, n, seed=1):
            req = router_pb2.GenerateRequest(prompt=prompt, max_new_tokens=n,
                                             temperature=0.8, top_k=40, seed=seed)
            start = time.time()
            got = [r.token for r in s.Generate(req, timeout=600)]
            took = time.time() - start
            if len(got) != n:
                sys.exit(f"generate_remote_bench: got {len(got)} tokens, expected {n}")
            return got, n / took

        experts = procs[:4]

        def cpu_now():
            """CPU seconds so far: the experts, the KV-cache router, this client."""
            t = os.times()
            return (sum(cpu_seconds(p.pid) for p in experts), cpu_seconds(kv_router.pid),
                    t.user + t.system)

        def run(streams):
            counts = []
            lock = threading.Lock()

            def one(seed):
                got, _ = tokens(stub, PROMPT, a.new_tokens, seed)
                with lock:
                    counts.append(len(got))
            threads = [threading.Thread(target=one, args=(s + 1,)) for s in range(streams)]
            start, cpu_start = time.time(), cpu_now()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            took = time.time() - start
            if len(counts) != streams or min(counts) != a.new_tokens:
                sys.exit(f"generate_remote_bench: streams got {counts} tokens, "
                         f"expected {a.new_tokens} each")
            n = sum(counts)
            # CPU ms per generated token: experts, router, client; idle share of the cores.
            used = [(e - b) * 1e3 / n for b, e in zip(cpu_start, cpu_now())]
            idle = 1 - sum(used) * n / 1e3 / (took * os.cpu_count())
            return n / took, used, idle

        run(1)  # warm
        tokens(recompute_stub, PROMPT, 4)
        rows, kv_rows, cpu_rows = [], [], []
        for _ in range(a.reps):
            one, one_cpu, one_idle = run(1)
            many, many_cpu, many_idle = run(a.streams)
            rows.append((one, many))
            cpu_rows.append((1, one_cpu, one_idle))
            cpu_rows.append((a.streams, many_cpu, many_idle))
            cached, kv_tps = tokens(stub, kv_prompt, a.kv_new_tokens)
            full, full_tps = tokens(recompute_stub, kv_prompt, a.kv_new_tokens)
            kv_rows.append((full_tps, kv_tps, cached == full))
    finally:
        stop_processes(procs, grace_s=20)
    shutil.rmtree(work, ignore_errors=True)

    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                if l.startswith("model name")), platform.machine())
    lines = [f"Measured {datetime.date.today()} on {cpu}, {os.cpu_count()} cores: 4 "
             "himoe-expert processes (1 thread each), himoe-router --checkpoint (1 thread) "
             f"and this client on the same host, the router's rows to the groups "
             f"{'through shared memory' if a.shared_memory else 'in the gRPC messages'}; block {a.block_size}, prompt {len(PROMPT)} "
             f"bytes, {a.new_tokens} new tokens per stream, temperature 0.8, top-k 40.", "",
             f"| rep | 1 stream, tokens/s | {a.streams} streams, tokens/s (total) | ratio |",
             "|---:|---:|---:|---:|"]
    for i, (one, many) in enumerate(rows, 1):
        lines.append(f"| {i} | {one:.1f} | {many:.1f} | {many / one:.2f} |")
    lines.append(f"| median | | | {median(m / o for o, m in rows):.2f} |")
    lines += ["", "CPU per generated token (ms, user + system, from /proc) and the share "
              f"of the {os.cpu_count()} cores left idle, per run:", "",
              "| streams | 4 experts | router | client | all | cores idle |",
              "|---:|---:|---:|---:|---:|---:|"]
    for streams, used, idle in cpu_rows:
        lines.append(f"| {streams} | {used[0]:.2f} | {used[1]:.2f} | {used[2]:.2f} | "
                     f"{sum(used):.2f} | {idle:.0%} |")
    lines += ["", f"One stream, a {a.kv_prompt}-byte prompt and {a.kv_new_tokens} new tokens "
              f"(contexts {a.kv_prompt}-{a.kv_prompt + a.kv_new_tokens - 1}), seed 1: the KV "
              "cache against a second router that recomputes the whole context "
              "(--kv_cache=false), on the same experts.", "",
              "| rep | full recompute, tokens/s | KV cache, tokens/s | ratio | same tokens |",
              "|---:|---:|---:|---:|---|"]
    for i, (full, kv, same) in enumerate(kv_rows, 1):
        lines.append(f"| {i} | {full:.1f} | {kv:.1f} | {kv / full:.2f} | "
                     f"{'yes' if same else 'no'} |")
    lines.append(f"| median | | | {median(kv / full for full, kv, _ in kv_rows):.2f} | |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
