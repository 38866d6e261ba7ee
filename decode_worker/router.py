"""Choosing a prefill node: round robin over the healthy ones.

Targets are ``host:port`` (one node) or ``dns:///name:port`` (every address the name resolves
to, re-resolved at each refresh, as a headless Kubernetes Service gives one per pod). A node is
healthy when its grpc.health.v1 check answers SERVING and its Handshake succeeded; refreshes
run every ``health_interval_s`` and a node that fails a call is skipped until the next one. A
name that fails to resolve keeps its last answer; a node that its name no longer gives is
disconnected once its pulls and grants are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from connector import DecodeConnector, PrefillPeer, StatusError, TlsConfig, open_channel

logger = logging.getLogger(__name__)

DNS_PREFIX = "dns:///"
HEALTH_CHECK_TIMEOUT_S = 5.0  # at most rpc_timeout_s, at least the health interval


def split_host_port(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"prefill target must be host:port or {DNS_PREFIX}name:port, got {target!r}")
    return host.strip("[]"), int(port)


def parse_targets(text: str) -> tuple[str, ...]:
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    if not targets:
        raise ValueError("at least one prefill target (host:port or dns:///name:port) is needed")
    for target in targets:
        split_host_port(target.removeprefix(DNS_PREFIX))
    return targets


class _Node:
    __slots__ = ("address", "peer", "healthy", "health_channel", "reason")

    def __init__(self, address: str, reconnect_ms: int, tls: TlsConfig | None) -> None:
        self.address = address
        self.peer: PrefillPeer | None = None
        self.healthy = False
        # Reconnect at least once per health interval: gRPC's default backoff grows to minutes,
        # which would hide a prefill node that came (back) up. Over TLS when the data plane is.
        self.health_channel = open_channel(address, tls, options=[
            ("grpc.initial_reconnect_backoff_ms", min(100, reconnect_ms)),
            ("grpc.min_reconnect_backoff_ms", min(100, reconnect_ms)),
            ("grpc.max_reconnect_backoff_ms", reconnect_ms),
        ])
        self.reason = "not checked yet"


async def resolve_host(host: str, port: int) -> list[str]:
    """``host:port`` for every address ``host`` resolves to (IPv6 in brackets). OSError when it
    does not resolve."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses: list[str] = []
    for family, *_, sockaddr in infos:
        address = f"[{sockaddr[0]}]:{port}" if family == socket.AF_INET6 else f"{sockaddr[0]}:{port}"
        if address not in addresses:
            addresses.append(address)
    return addresses


class PrefillRouter:
    """``resolver(host, port)`` turns a ``dns:///`` target into addresses (``resolve_host`` by
    default). A node gone from DNS leaves the rotation at once; its channel closes once no pull
    or grant needs it."""

    def __init__(self, connector: DecodeConnector, targets: tuple[str, ...], *, health_interval_s: float,
                 rpc_timeout_s: float, tls: TlsConfig | None = None,
                 resolver: Callable[[str, int], Awaitable[list[str]]] = resolve_host) -> None:
        self.connector = connector
        self._resolver = resolver
        self._resolved: dict[str, list[str]] = {}  # dns target -> its last answer
        self.tls = tls
        self.targets = targets
        self.health_interval_s = health_interval_s
        self.rpc_timeout_s = rpc_timeout_s
        self.check_timeout_s = max(health_interval_s, min(rpc_timeout_s, HEALTH_CHECK_TIMEOUT_S))
        self._nodes: dict[str, _Node] = {}
        self._retiring: list[PrefillPeer] = []  # replaced or gone from DNS; closed once no call or grant needs them
        self._next = 0
        self._task: asyncio.Task | None = None
        self._refresh_lock = asyncio.Lock()

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever(), name="prefill-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for node in self._nodes.values():
            await node.health_channel.close()
        self._nodes.clear()

    async def _resolve(self) -> list[str]:
        """Every target's addresses; a name that fails to resolve keeps its last answer."""
        addresses: list[str] = []
        for target in self.targets:
            if not target.startswith(DNS_PREFIX):
                found = [target]
            else:
                host, port = split_host_port(target.removeprefix(DNS_PREFIX))
                try:
                    found = await asyncio.wait_for(self._resolver(host, port), self.rpc_timeout_s)
                    self._resolved[target] = found
                except (OSError, asyncio.TimeoutError) as exc:
                    found = self._resolved.get(target, [])
                    logger.warning("cannot resolve %s (%s); keeping its last %d addresses", host, exc or "timeout",
                                   len(found))
            addresses += [a for a in found if a not in addresses]
        return addresses

    async def _check(self, node: _Node) -> None:
        stub = health_pb2_grpc.HealthStub(node.health_channel)
        try:
            # A check may take longer than the interval on a busy node; a short deadline would
            # take a healthy node out of rotation (and, on its return, cost its pulls in flight).
            response = await stub.Check(health_pb2.HealthCheckRequest(service=""), wait_for_ready=not node.healthy,
                                        timeout=self.check_timeout_s)
            serving = response.status == health_pb2.HealthCheckResponse.SERVING
            node.reason = "" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        except grpc.aio.AioRpcError as exc:
            serving, node.reason = False, f"health check: {exc.code().name}"
        if serving and node.peer is None:
            try:
                # The node may be a new process on the same address (and, in a StatefulSet, with
                # the same engine id): handshake on a new channel; the old one closes once the
                # pulls and grants in flight on it are done.
                node.peer = await self.connector.connect(node.address)
                self._retire(node.address, keep=node.peer)
                logger.info("connected to prefill node %s (%s)", node.address, node.peer.engine_id)
            except StatusError as exc:
                serving, node.reason = False, str(exc)
        if not serving:
            node.peer = None  # handshake again once it is back: it may be a new process
        if serving != node.healthy:
            logger.info("prefill node %s is %s", node.address, "healthy" if serving else f"unhealthy: {node.reason}")
        node.healthy = serving

    async def refresh(self) -> None:
        async with self._refresh_lock:
            addresses = await self._resolve()
            for address in list(self._nodes):
                if address not in addresses:
                    node = self._nodes.pop(address)
                    logger.info("prefill node %s is gone from %s", address, self.targets)
                    await node.health_channel.close()
                    self._retire(address)
            for address in addresses:
                if address not in self._nodes:
                    self._nodes[address] = _Node(address, max(100, int(self.health_interval_s * 1000)), self.tls)
            await asyncio.gather(*(self._check(n) for n in self._nodes.values()))
            await self._close_idle_retired()

    def _retire(self, address: str, keep: PrefillPeer | None = None) -> None:
        """Stop handing out the peers of ``address`` (but ``keep``); close each once idle."""
        self._retiring += [p for p in self.connector.peers
                           if p.address == address and p is not keep and p not in self._retiring]

    async def _close_idle_retired(self) -> None:
        """Close retired peers whose pulls and grants are done (a grant never pulled nor
        released keeps its peer until its lease ends)."""
        for peer in [p for p in self._retiring if not p.busy]:
            self._retiring.remove(peer)
            await self.connector.disconnect(peer)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            with contextlib.suppress(Exception):
                await self.refresh()

    def healthy(self) -> list[str]:
        return [n.address for n in self._nodes.values() if n.healthy and n.peer is not None]

    async def pick(self) -> PrefillPeer:
        """The next healthy node's peer (round robin). UNAVAILABLE when none is healthy after
        one more refresh."""
        for attempt in range(2):
            nodes = [n for n in self._nodes.values() if n.healthy and n.peer is not None]
            if nodes:
                node = nodes[self._next % len(nodes)]
                self._next += 1
                return node.peer
            if attempt == 0:
                await self.refresh()
        reasons = "; ".join(f"{n.address}: {n.reason}" for n in self._nodes.values()) or "no address resolved"
        raise StatusError(grpc.StatusCode.UNAVAILABLE, f"no healthy prefill node among {list(self.targets)} ({reasons})")

    def mark_failed(self, peer: PrefillPeer, reason: str) -> None:
        """Skip the node until its next health check passes."""
        node = self._nodes.get(peer.address)
        if node is not None and node.healthy:
            node.healthy, node.reason, node.peer = False, reason, None
            logger.warning("prefill node %s failed a call (%s); skipping it until its next health check",
                           peer.address, reason)
