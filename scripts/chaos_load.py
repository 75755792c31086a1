#!/usr/bin/python3
"""The load client of scripts/chaos.py serve: bounded concurrent RouteForward
and Generate calls to a router for --seconds, every answer checked against the
in-process reference that tests/trainer/himoe_serve_reference wrote (--refs):

  RouteForward   the output must be within --tolerance of the reference's
  Generate       the streamed tokens must be the reference's (a stream that
                 ends with an error: a prefix of them)

One JSON line a call (--out): start and end (time.time()), kind, request
index, gRPC code, its details, and verdict "ok", "wrong" or "error". Needs
/usr/bin/python3 with Debian's python3-grpcio, python3-grpc-tools and
python3-numpy; run it where the router is reachable (chaos.py runs it in the
coordinator's namespace).
"""
import argparse
import json
import os
import sys
import threading
import time

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak import stubs  # noqa: E402

# A restarted router is found within half a second: reconnect attempts at
# most 0.5 s apart (gRPC's default backoff grows to 120 s), and the address
# resolved again at once (by default at most every 30 s, so that after a
# SIGKILLed router a client kept failing for ~7 s after its return).
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 500),
                   ("grpc.dns_min_time_between_resolutions_ms", 100)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", required=True, help="host:port")
    ap.add_argument("--refs", required=True, help="himoe_serve_reference's --out_dir")
    ap.add_argument("--gen", required=True, help="where the Python stubs are generated")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--forward_clients", type=int, default=2)
    ap.add_argument("--generate_clients", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=10, help="client deadline of a call, s")
    ap.add_argument("--tolerance", type=float, default=1e-5)
    ap.add_argument("--retry_s", type=float, default=0.05, help="pause after a failed call")
    ap.add_argument("--start_file", default="", help="written once the load begins")
    a = ap.parse_args()

    router_pb2, router_pb2_grpc, tensor_pb2 = stubs(a.gen)
    with open(os.path.join(a.refs, "manifest.json")) as f:
        manifest = json.load(f)

    def tensor(name):
        t = tensor_pb2.Tensor()
        with open(os.path.join(a.refs, name), "rb") as f:
            t.ParseFromString(f.read())
        return t

    forwards = []
    for r in manifest["forward"]:
        x, y = tensor(r["x"]), tensor(r["y"])
        want = np.frombuffer(y.data, dtype=np.float32).reshape(list(y.shape))
        forwards.append((router_pb2.RouteForwardRequest(layer=r["layer"], hidden=x), want))
    generates = [(router_pb2.GenerateRequest(
        prompt=g["prompt"].encode(), max_new_tokens=g["max_new_tokens"],
        temperature=g["temperature"], top_k=g["top_k"], seed=g["seed"]), g["tokens"])
        for g in manifest["generate"]]

    stub = router_pb2_grpc.RouterServiceStub(
        grpc.insecure_channel(a.router, options=CHANNEL_OPTIONS))
    out = open(a.out, "w")
    lock = threading.Lock()
    end = time.time() + a.seconds

    def record(**r):
        with lock:
            out.write(json.dumps(r) + "\n")
            out.flush()

    def forward_client(c):
        i = c
        while time.time() < end:
            request, want = forwards[i % len(forwards)]
            t0 = time.time()
            try:
                y = stub.RouteForward(request, timeout=a.timeout)
                got = np.frombuffer(y.output.data, dtype=np.float32)
                err = float(np.abs(got.reshape(want.shape) - want).max()) \
                    if got.size == want.size else float("inf")
                record(t0=t0, t1=time.time(), kind="forward", i=i % len(forwards), code="OK",
                       detail=f"max |y - reference| {err:.3g}",
                       verdict="ok" if err <= a.tolerance else "wrong")
            except grpc.RpcError as e:
                record(t0=t0, t1=time.time(), kind="forward", i=i % len(forwards),
                       code=e.code().name, detail=e.details() or "", verdict="error")
                time.sleep(a.retry_s)
            i += 1

    def generate_client(c):
        i = c
        while time.time() < end:
            request, want = generates[i % len(generates)]
            tokens = []
            t0 = time.time()
            code, detail = "OK", ""
            try:
                for response in stub.Generate(request, timeout=a.timeout):
                    tokens.append(response.token)
            except grpc.RpcError as e:
                code, detail = e.code().name, e.details() or ""
            prefix = tokens == want[:len(tokens)]
            verdict = "ok" if code == "OK" and tokens == want else \
                "error" if code != "OK" and prefix else "wrong"
            if verdict == "wrong":
                detail += f" (tokens {tokens}, reference {want})"
            record(t0=t0, t1=time.time(), kind="generate", i=i % len(generates), code=code,
                   detail=detail, tokens=len(tokens), verdict=verdict)
            if code != "OK":
                time.sleep(a.retry_s)
            i += 1

    threads = [threading.Thread(target=forward_client, args=(c,))
               for c in range(a.forward_clients)]
    threads += [threading.Thread(target=generate_client, args=(c,))
                for c in range(a.generate_clients)]
    if a.start_file:
        with open(a.start_file, "w") as f:
            f.write(f"{time.time()}\n")
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
