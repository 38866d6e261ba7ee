"""What a launcher (the kubelet, ``kpool_pd.launcher``) sees of a daemon process: the ready file
it polls for, and the signals that stop it (SIGTERM; SIGINT from a terminal) by starting a drain."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path

logger = logging.getLogger(__name__)
TERMINATION = (signal.SIGTERM, signal.SIGINT)


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
