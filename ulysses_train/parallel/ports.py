"""A free TCP port for a process group's rendezvous, chosen so that nothing else on the machine takes it before the
group binds it."""
from __future__ import annotations

import random
import socket

LOWEST_FREE_PORT = 20000
"""free_port picks from here up to the start of the OS's ephemeral range (below 32768 by Linux's default)."""


def free_port() -> int:
    """A TCP port no process listens on now, for a group started next to another job on the same machine, where the
    fixed default would collide (EADDRINUSE). Taken below the OS's ephemeral range: the group binds it seconds later,
    after its imports, and a port from that range (what bind(0) gives) can be taken in between as the source port of
    any connection the machine opens (gloo opens many). Falls back to bind(0) when that range leaves no room."""
    low = ephemeral_ports()[0]
    for port in random.SystemRandom().sample(range(LOWEST_FREE_PORT, low), min(64, max(0, low - LOWEST_FREE_PORT))):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
                return port
            except OSError:
                continue
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ephemeral_ports() -> tuple[int, int]:
    """The range the OS picks source ports and bind(0) ports from (Linux's ip_local_port_range; its default
    elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = fh.read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999
