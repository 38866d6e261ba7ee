"""What a launcher (the kubelet, ``kpool_pd.launcher``) sees of a daemon process: the ready file
it polls for, and the signals that stop it (SIGTERM; SIGINT from a terminal) by starting a drain;
and the one interpreter setting a daemon changes (``keep_event_loop_responsive``)."""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import sys
from pathlib import Path

logger = logging.getLogger(__name__)
TERMINATION = (signal.SIGTERM, signal.SIGINT)
# How long a thread that wants the GIL waits before the holder must give it up (Python's default: 5 ms).
EVENT_LOOP_GIL_WAIT_S = 0.0005


def keep_event_loop_responsive() -> float:
    """A daemon's model steps run in a worker thread while its event loop carries the transfers and
    RPCs; each step of a pull (a message read, a send posted, a receive completed) waits for the GIL
    when the model holds it. Cap that wait at ``EVENT_LOOP_GIL_WAIT_S`` instead of Python's 5 ms, at
    the cost of more frequent thread switches while both are busy. Returns the interval it replaced
    (``sys.setswitchinterval`` puts it back)."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(EVENT_LOOP_GIL_WAIT_S)
    return previous


def write_ready_file(path: str, **info: object) -> None:
    """Atomically write ``info`` plus ``pid`` as one JSON object to ``path`` (empty: nothing).
    A launcher polls for the file; it never sees a partial one."""
    if not path:
        return
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({**info, "pid": os.getpid()}))
    tmp.replace(target)


def termination_event(loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Event:
    """An event that the first SIGTERM or SIGINT sets, logging ``<SIGNAL>: draining``. Call it
    on the event loop that awaits the event (``loop``: the running loop). Later signals are
    logged and change nothing."""
    loop = asyncio.get_running_loop() if loop is None else loop
    event = asyncio.Event()

    def on_signal(name: str) -> None:
        logger.info("%s: draining", name)
        event.set()
    for sig in TERMINATION:
        loop.add_signal_handler(sig, on_signal, sig.name)
    return event


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def parent_death_signal(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` that has the child receive ``sig`` when the thread that forks it dies
    (Linux ``prctl(PR_SET_PDEATHSIG)``; it survives the exec); None where there is no prctl.
    If the parent is already gone when the child arms it, the child sends ``sig`` to itself."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:  # in the child, between fork and exec: system calls only
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)
    return arm
