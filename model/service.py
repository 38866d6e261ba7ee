"""Process plumbing both daemons share: metrics endpoint, plaintext health port, readiness file, signals."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server

logger = logging.getLogger(__name__)


def default_engine_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def start_metrics(host: str, port: int, registry: CollectorRegistry):
    """Serve ``/metrics`` for ``registry``; returns (server or None, bound port or -1)."""
    if port < 0:
        return None, -1
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port


def write_ready_file(path: str, **info: object) -> None:
    """Atomically write ``info`` (plus the pid) as JSON: a launcher polls for this file."""
    if not path:
        return
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({**info, "pid": os.getpid()}))
    tmp.replace(target)


def on_termination(loop: asyncio.AbstractEventLoop, callback: Callable[[str], None]) -> None:
    """Call ``callback(signal name)`` on SIGTERM and SIGINT, from the event loop."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, callback, sig.name)
