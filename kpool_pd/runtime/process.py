"""What a launcher (the kubelet, ``kpool_pd.runtime.launch``) sees of a daemon process: the ready file
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
# Set by a launcher in a child's environment: "<launcher pid>:<signal number>" (parent_death_env).
PARENT_DEATH_ENV = "KPOOLPD_PARENT_DEATH_SIGNAL"


def parent_death_env(sig: int = signal.SIGTERM) -> dict[str, str]:
    """The environment entry that has a daemon started from this thread receive ``sig`` when this
    thread dies, however it dies (SIGKILL included): the daemon arms it as it starts
    (``arm_parent_death_signal``). The child is started without a ``preexec_fn``, so Python spawns
    it with vfork, which runs no fork handlers: gRPC's, run in a forked child while the parent's
    gRPC threads are live, can crash that child (grpc/grpc#43055) or block the fork."""
    return {PARENT_DEATH_ENV: f"{os.getpid()}:{int(sig)}"}


def arm_parent_death_signal(environ: dict[str, str] | None = None) -> bool:
    """In a child started with ``parent_death_env``: have the kernel send the signal it names when
    the parent thread dies (Linux ``prctl(PR_SET_PDEATHSIG)``), or send it now if the parent is
    already gone. Takes the entry out of ``environ`` (default ``os.environ``) so that this process's
    own children do not inherit it. Returns whether a signal was armed (False: no entry, or no prctl)."""
    environ = os.environ if environ is None else environ
    value = environ.pop(PARENT_DEATH_ENV, "")
    if not value:
        return False
    try:
        parent, sig = (int(part) for part in value.split(":"))
    except ValueError:
        raise ValueError(f"{PARENT_DEATH_ENV}={value!r}: expected <parent pid>:<signal number>") from None
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl(PR_SET_PDEATHSIG, {sig}) failed")
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)
    return True
