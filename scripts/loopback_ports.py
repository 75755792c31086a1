"""Free loopback ports for services that must be given a fixed port.

A port the kernel hands out for port 0 lies in the ephemeral range
(net.ipv4.ip_local_port_range), where any outgoing connection may take it as
its source port between the pick and the service's bind. These ports are
drawn at random below that range instead, where the kernel assigns nothing.
"""

import random
import socket

RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST = 10000


def ephemeral_low():
    try:
        with open(RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n, host="127.0.0.1"):
    """n distinct ports that were free on host, all bound at once, then released."""
    high = ephemeral_low()
    rng = random.SystemRandom()
    socks = []
    try:
        for _ in range(20 * n + 100):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, rng.randrange(LOWEST, high) if high > LOWEST + 1000 else 0))
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) != n:
            raise RuntimeError(f"found {len(socks)} free ports on {host}, needed {n}")
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
