"""What a daemon declares to the runtime: its role, its option table and how to build its node;
and the contract of the node it builds.

The runtime (``kpool_pd.runtime.daemon``) does the rest the same way for every daemon: it builds the node,
warms it up, serves its servicer with auth, TLS and health, exposes ``/metrics``, writes the
ready file, waits for SIGTERM, drains and closes.
"""

from __future__ import annotations

import functools

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from prometheus_client import CollectorRegistry

from kpool_pd.connector import UCX_NO_SHARED_MEMORY, ConnectorConfig, TlsConfig, bind_ucx_options
from kpool_pd.kvcache import NodeCache
from kpool_pd.runtime.grpc_server import Servicer
from kpool_pd.runtime.health_gate import HealthGate
from kpool_pd.runtime.options import Option, Role
from kpool_pd.runtime.service_options import service_options
from kpool_pd.runtime.tls import TLS_OPTIONS
from kpool_pd.runtime.transports import Transports

LOOPBACK = "127.0.0.1"  # where a loopback_only node serves

# Settings keys the runtime reads itself; every daemon's table has them.
RUNTIME_KEYS = frozenset(option.key for option in (*service_options(grpc_port=0, metrics_port=0), *TLS_OPTIONS))


def default_engine_id(role: Role | str) -> str:
    """``<role>-<hostname>-<pid>``: unique per process, readable in logs."""
    return f"{Role(role).value}-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, kw_only=True)
class NodeContext:
    """What the runtime hands a daemon's ``build``: the settings and the process-wide pieces."""

    role: Role
    settings: Mapping[str, Any]
    device: torch.device
    tls: TlsConfig | None
    transports: Transports
    registry: CollectorRegistry  # served at /metrics
    engine_id: str
    health: HealthGate = field(default_factory=HealthGate)  # a node that cannot always serve reports it here

    @functools.cached_property
    def connector_config(self) -> ConnectorConfig:
        """The connector settings every node shares: the peer token, TLS, lease and deadlines (a
        node may ``dataclasses.replace`` what is its own). The client token is no connector's.
        Built once: choosing UCX's interfaces lists the host's and resolves names."""
        s = self.settings
        return ConnectorConfig(lease_s=s["lease_s"], peer_token=s["peer_token"] or None, tls=self.tls,
                               rpc_timeout_s=s["rpc_timeout_s"], transfer_timeout_s=s["transfer_timeout_s"],
                               pull_session_idle_s=s["pull_session_idle_s"], ucx_progress=s["ucx_progress"],
                               ucx_options=bind_ucx_options(UCX_NO_SHARED_MEMORY, s["host"], s.get("prefill", "")))


class Node(Protocol):
    """One daemon's running parts, as the runtime drives them, in this order, once each:
    ``warm_up`` (in a worker thread), ``start``, then, after SIGTERM, ``drain`` and polling
    ``idle`` until true or the drain time is up, then ``close`` (also when anything before it
    failed, so it must cope with a node that never started)."""

    servicer: Servicer  # registered on the daemon's gRPC server before it starts
    cache: NodeCache  # the node's cache, its one owner (its free counts are served at /metrics and logged at stop)

    def warm_up(self) -> None:
        """Run the model once through the cache so that the first request is not slow; blocking.
        Releases every allocation it made."""

    async def start(self) -> None:
        """Start background tasks and peers, on the serving event loop, before the server binds."""

    def drain(self) -> None:
        """Refuse new work from now on (UNAVAILABLE, so callers try another node)."""

    @property
    def idle(self) -> bool:
        """Nothing left in flight that a drain waits for."""

    def leftover(self) -> str | None:
        """What is still in flight, in words (``"3 grants still held; freeing them"``), or None."""

    async def close(self) -> None:
        """Stop every task and free every resource; called after the server stopped. Idempotent."""

    def describe(self) -> dict[str, object]:
        """Fields of the ``<role> node ready`` log line (model, layout hash, peers)."""

    # Optional: its load now (``kpool_pd.runtime.load_report.NodeLoad``), which its health Check answers carry
    # to the peers that check it (a prefill node: decode nodes pick the least loaded). Called on the event loop.
    # def load(self) -> NodeLoad: ...

    # Optional: why the node stopped by itself, if it broke (empty: it did not). A node that sets it
    # has the process exit with status 1, so that a supervisor restarts it.
    # failure: str


@dataclass(frozen=True, kw_only=True)
class DaemonSpec:
    """A daemon: ``build`` makes its node from the settings that ``options`` parse."""

    role: Role
    description: str  # the first line of --help
    options: tuple[Option, ...]
    build: Callable[[NodeContext], Node]
    # Checks of the settings together, before anything starts: raise SettingsError (or ValueError)
    # saying what cannot work; the daemon then exits with status 2 naming it.
    check: Callable[[Mapping[str, Any]], None] | None = None
    # A node only processes of its own host call (a DCP rank): its gRPC server binds loopback whatever
    # --host says, in plaintext (its callers present the token), with no health or metrics port.
    loopback_only: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise TypeError(f"role must be a Role, got {self.role!r}")
        names = [option.name for option in self.options]
        doubled = sorted({name for name in names if names.count(name) > 1})
        if doubled:
            raise ValueError(f"{self.role.value}: options declared twice: {doubled}")
        missing = sorted(RUNTIME_KEYS - {option.key for option in self.options})
        if missing:
            raise ValueError(f"{self.role.value}: the runtime needs options {missing}")
