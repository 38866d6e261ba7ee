"""Stopping a test's vLLM engines (``EngineProcess``) or servers (``vllm_servers.Server``) all at once, once
its assertions are done: each is asked to stop, then all are waited for under one shared grace period, then
what is left is killed. Stopped one after the other, each waited its own grace period in turn, and an engine
whose exit hangs (a TP engine waits for its worker ranks, which vLLM's executor gives 5 s and then signals)
held up the ones behind it: five engines of test_vllm_ranks took 45 s to stop on a loaded machine."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from kpool_pd.bench import vllm_engines
from tests.support import vllm_servers

GRACE_S = 15  # for all of them together, after which the rest are killed (the tests' facts are checked by then)
KILLED_S = 30  # a killed process is gone within this


def stop_engines(engines: Iterable[vllm_engines.EngineProcess], grace_s: float = GRACE_S) -> None:
    """Each engine's job queue told to stop, then each joined until one shared deadline, then the rest killed
    with every process they started (a TP engine's worker ranks)."""
    engines = list(engines)
    for engine in engines:
        if engine.process.is_alive():
            engine.jobs.put(None)
    deadline = time.monotonic() + grace_s
    for engine in engines:
        engine.process.join(max(0.0, deadline - time.monotonic()))
    for engine in engines:
        if engine.process.is_alive():
            for pid in _descendants(engine.process.pid):  # a TP engine's worker ranks, which may hang as it did
                _kill(pid)
            engine.process.kill()
    for engine in engines:
        engine.process.join(KILLED_S)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (``/proc``: the children of each of its threads, then theirs)."""
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in map(int, (task / "children").read_text().split()):
                found += [child, *_descendants(child)]
    except OSError:  # gone meanwhile
        pass
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_servers(servers: Iterable[vllm_servers.Server], grace_s: float = GRACE_S) -> None:
    """SIGTERM to each server's process group, each waited for until one shared deadline, then SIGKILL to every
    group (its engine processes too, whether or not the server waited for them)."""
    servers = list(servers)
    for server in servers:
        server.kill(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for server in servers:
        try:
            server.process.wait(max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for server in servers:
        server.kill(signal.SIGKILL)
    for server in servers:
        server.wait_gone()  # under a deadline stretched for the load
