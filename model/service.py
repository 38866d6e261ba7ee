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

import grpc
from grpc_health.v1 import health, health_pb2_grpc
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



async def start_health_server(host: str, port: int, servicer: health.aio.HealthServicer) -> tuple[grpc.aio.Server | None, int]:
    """Serve ``servicer`` (grpc.health.v1 only) in plaintext on ``host:port``, for probes that
    cannot speak TLS (the kubelet's gRPC probes); returns (server or None, bound port or -1).
    The same servicer may also be served on the daemon's main port."""
    if port < 0:
        return None, -1
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound
