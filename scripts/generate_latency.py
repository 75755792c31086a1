#!/usr/bin/python3
"""Time per token of one Generate stream from a himoe-router, as an outside
grpcio client sees it: the median over --reps streams of (last token's
arrival - first token's) / (tokens - 1), in ms. Prints that one number.

  generate_latency.py --address 127.0.0.1:PORT [--new_tokens 64] [--reps 3]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak import stubs  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as gen:
        router_pb2, router_pb2_grpc, _ = stubs(gen)
        stub = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(a.address))
        per_token = []
        for rep in range(a.reps):
            request = router_pb2.GenerateRequest(prompt=b"The fortune says",
                                                 max_new_tokens=a.new_tokens, temperature=0.8,
                                                 top_k=40, seed=rep + 1)
            arrivals = [time.perf_counter() for _ in stub.Generate(request, timeout=600)]
            if len(arrivals) != a.new_tokens:
                sys.exit(f"generate_latency: {len(arrivals)} tokens, expected {a.new_tokens}")
            per_token.append((arrivals[-1] - arrivals[0]) / (len(arrivals) - 1))
    print(f"{1000 * statistics.median(per_token):.3f}")


if __name__ == "__main__":
    main()
