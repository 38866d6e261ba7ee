"""Free ports for tests that must name a port before anything binds it (a daemon told where its
prefill node will listen, an address where nothing listens).

A port bound to 0 and closed again can be handed by the kernel to the next ``bind(0)`` of another
process, such as a second pytest-xdist worker, before the test uses it. ``free_port`` hands out
ports below the kernel's ephemeral range (which a ``bind(0)`` never picks), from a span of its own
per xdist worker, each checked free when handed out. A process starts at a random place in its span, so that
another copy of the suite running beside this one (its workers' spans are the same) rarely reaches for the ports
this one just handed out.
"""

from __future__ import annotations

import itertools
import os
import random
import socket

LOOPBACK = "127.0.0.1"
FIRST_PORT = 20000  # below Linux's ephemeral range (32768 and up by default)
SPAN = 1500  # ports per xdist worker
WORKERS = 8  # spans below the ephemeral range


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw0", "gw1", ...; unset without xdist
    return int(worker.removeprefix("gw") or 0) % WORKERS


def _span_from_a_random_place() -> itertools.cycle:
    first = FIRST_PORT + _worker_index() * SPAN
    start = random.SystemRandom().randrange(SPAN)
    return itertools.cycle([*range(first + start, first + SPAN), *range(first, first + start)])


_candidates = _span_from_a_random_place()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port of this worker's span that nothing on loopback holds now (RuntimeError when none is)."""
    for _ in range(SPAN):
        port = next(_candidates)
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port in {FIRST_PORT + _worker_index() * SPAN}..+{SPAN} on {LOOPBACK}")


def consecutive_ports(count: int) -> list[int]:
    """``count`` consecutive free ports (a producer of TP ``count`` serves on its ``listen`` port and the next)."""
    ports = [free_port()]
    while len(ports) < count:
        port = free_port()
        ports = [*ports, port] if port == ports[-1] + 1 else [port]
    return ports
