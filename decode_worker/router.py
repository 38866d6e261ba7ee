"""Choosing a prefill node: round robin over the healthy ones.

Targets are ``host:port`` (one node) or ``dns:///name:port`` (every address the name resolves
to, re-resolved at each refresh, as a headless Kubernetes Service gives one per pod). A node is
healthy when its grpc.health.v1 check answers SERVING and its Handshake succeeded; refreshes
run every ``health_interval_s`` and a node that fails a call is skipped until the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from connector.config import TlsConfig
from connector.decode import DecodeConnector, PrefillPeer
from connector.errors import TransferError
from connector.daemon_tls import open_channel

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


class PrefillRouter:
    def __init__(self, connector: DecodeConnector, targets: tuple[str, ...], *, health_interval_s: float,
                 rpc_timeout_s: float, tls: TlsConfig | None = None) -> None:
        self.connector = connector
        self.tls = tls
        self.targets = targets
        self.health_interval_s = health_interval_s
        self.rpc_timeout_s = rpc_timeout_s
        self.check_timeout_s = max(health_interval_s, min(rpc_timeout_s, HEALTH_CHECK_TIMEOUT_S))
        self._nodes: dict[str, _Node] = {}
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
        addresses: list[str] = []
        loop = asyncio.get_running_loop()
        for target in self.targets:
            if not target.startswith(DNS_PREFIX):
                addresses.append(target)
                continue
            host, port = split_host_port(target.removeprefix(DNS_PREFIX))
            try:
                infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), self.rpc_timeout_s)
            except (OSError, asyncio.TimeoutError) as exc:
                logger.warning("cannot resolve %s: %s", host, exc)
                continue
            for family, *_, sockaddr in infos:
                ip = sockaddr[0]
                address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
                if address not in addresses:
                    addresses.append(address)
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
                # the same engine id): drop the old channel before handshaking on a new one.
                await self.connector.disconnect(node.address)
                node.peer = await self.connector.connect(node.address)
                logger.info("connected to prefill node %s (%s)", node.address, node.peer.engine_id)
            except TransferError as exc:
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
            for address in addresses:
                if address not in self._nodes:
                    self._nodes[address] = _Node(address, max(100, int(self.health_interval_s * 1000)), self.tls)
            await asyncio.gather(*(self._check(n) for n in self._nodes.values()))

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
        raise TransferError(grpc.StatusCode.UNAVAILABLE, f"no healthy prefill node among {list(self.targets)} ({reasons})")

    def mark_failed(self, peer: PrefillPeer, reason: str) -> None:
        """Skip the node until its next health check passes."""
        node = self._nodes.get(peer.address)
        if node is not None and node.healthy:
            node.healthy, node.reason, node.peer = False, reason, None
            logger.warning("prefill node %s failed a call (%s); skipping it until its next health check",
                           peer.address, reason)
