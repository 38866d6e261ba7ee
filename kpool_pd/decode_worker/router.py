"""Choosing a prefill node among the healthy ones: the least loaded (by the load their health checks
report, plus this node's picks since), or round robin (``PrefillPolicy``; ``prefill_choice`` says how).

Targets are ``host:port`` (one node) or ``dns:///name:port`` (every address the name resolves
to, re-resolved at each refresh, as a headless Kubernetes Service gives one per pod). A node is
healthy when its grpc.health.v1 check answers SERVING and its Handshake succeeded; refreshes
run every ``health_interval_s`` and a node that fails a call is skipped until the next one. A
name that fails to resolve keeps its last answer; a node that its name no longer gives is
disconnected once its pulls and grants are done.

Checks never wait for a connection: a node that cannot be reached fails its check at once, and
each node keeps the last reason it is unusable, in words (``connection refused``, ``TLS
handshake failed: ...``, a Handshake refused for its layout or token; see
``kpool_pd.decode_worker.diagnosis``). A request that finds no node healthy asks for refreshes at once
and waits at most ``NO_NODE_WAIT_S`` for one, then fails with UNAVAILABLE naming every node and
its reason. ``on_change(usable)`` hears each time the router gains its first usable node or
loses its last (the decode node's health follows it). Each node's load comes back on its health
check's answer (``kpool_pd.runtime.load_report``): no call is added per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from kpool_pd.connector import DecodeConnector, PrefillPeer, StatusError, TlsConfig, open_channel
from kpool_pd.decode_worker.diagnosis import closed_at_once, failure_reason, plaintext_to_tls_reason, speaks_tls
from kpool_pd.decode_worker.prefill_choice import LoadView, PrefillChooser, PrefillPolicy
from kpool_pd.runtime.load_report import NodeLoad

logger = logging.getLogger(__name__)

DNS_PREFIX = "dns:///"
HEALTH_CHECK_TIMEOUT_S = 5.0  # at most rpc_timeout_s, at least the health interval
SLOW_CHECKS_TOLERATED = 2  # a healthy node's checks in a row that may go unanswered before it leaves the rotation
NO_NODE_WAIT_S = 1.5  # how long a request waits for a prefill node to turn healthy before UNAVAILABLE
KICK_GAP_S = 0.1  # least time between two refreshes that waiting requests ask for
MAX_RECONNECT_BACKOFF_MS = 1000  # an unreachable node's channel retries at least this often


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
    __slots__ = ("address", "peer", "healthy", "health_channel", "reason", "load", "slow_checks")

    def __init__(self, address: str, reconnect_ms: int, tls: TlsConfig | None) -> None:
        self.address = address
        self.peer: PrefillPeer | None = None
        self.healthy = False
        # Reconnect at least once per health interval (and second): gRPC's default backoff grows to
        # minutes, which would hide a prefill node that came (back) up. Over TLS when the data plane is.
        self.health_channel = open_channel(address, tls, options=[
            ("grpc.initial_reconnect_backoff_ms", min(100, reconnect_ms)),
            ("grpc.min_reconnect_backoff_ms", min(100, reconnect_ms)),
            ("grpc.max_reconnect_backoff_ms", reconnect_ms),
        ])
        self.reason = "not checked yet"
        self.load = LoadView()
        self.slow_checks = 0  # this healthy node's checks in a row that ran past their deadline


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
    or grant needs it. ``on_change(usable)`` is called on the event loop, first by ``start``, then
    whenever ``usable`` flips; ``no_node_wait_s`` bounds how long ``pick`` waits for a node; ``policy``
    is how ``pick`` chooses (the least loaded node by default). With ``registry``, each node's picks are
    counted there (``kpoolpd_decode_prefill_picks``)."""

    def __init__(self, connector: DecodeConnector, targets: tuple[str, ...], *, health_interval_s: float,
                 rpc_timeout_s: float, tls: TlsConfig | None = None,
                 resolver: Callable[[str, int], Awaitable[list[str]]] = resolve_host,
                 on_change: Callable[[bool], None] | None = None, no_node_wait_s: float = NO_NODE_WAIT_S,
                 policy: PrefillPolicy = PrefillPolicy.LEAST_LOADED, registry: CollectorRegistry | None = None) -> None:
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
        self.chooser = PrefillChooser(policy)
        self.checks = 0  # health checks sent (each carries a load report back)
        self._picks = None if registry is None else Counter(
            "kpoolpd_decode_prefill_picks", "Requests sent to each prefill node", ["prefill"], registry=registry)
        self._task: asyncio.Task | None = None
        self._refresh_lock = asyncio.Lock()
        self.on_change = on_change
        self.no_node_wait_s = no_node_wait_s
        self._usable: bool | None = None  # as last reported to on_change
        self._some_healthy = asyncio.Event()  # set while a node is usable: what a waiting pick awaits
        self._kick = asyncio.Event()  # a request waits for a node: refresh now

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
        covers = self.chooser.picks  # the picks this check's load report will include
        self.checks += 1
        try:
            # A check may take longer than the interval on a busy node; a short deadline would
            # take a healthy node out of rotation (and, on its return, cost its pulls in flight).
            # It never waits for a connection: an unreachable node fails at once, with the reason.
            # Health needs no credential: the peer token is never sent (the connector proves it when it connects).
            call = stub.Check(health_pb2.HealthCheckRequest(service=""), wait_for_ready=False,
                              timeout=self.check_timeout_s)
            response = await call
            serving = response.status == health_pb2.HealthCheckResponse.SERVING
            node.load.reported(self._load_of(node, await call.trailing_metadata()), covers)
            node.reason = "" if serving else (
                f"its health is {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}")
        except grpc.aio.AioRpcError as exc:
            if self._tolerated(node, exc):
                return
            serving, node.reason = False, await self._failure_reason(node, exc)
        node.slow_checks = 0
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
            node.load.forget()
        if serving != node.healthy:
            logger.info("prefill node %s is %s", node.address, "healthy" if serving else f"unhealthy: {node.reason}")
        node.healthy = serving
        self._changed()

    def _tolerated(self, node: _Node, exc: grpc.aio.AioRpcError) -> bool:
        """Whether a failed check leaves ``node`` as it was: a healthy node that let a check run past its deadline
        is busy rather than gone (an unreachable one fails at once), and stays in the rotation until
        ``SLOW_CHECKS_TOLERATED`` checks in a row did; an overloaded machine's only prefill node otherwise left it
        for a second and failed every request that came meanwhile."""
        if not (node.healthy and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                and node.slow_checks < SLOW_CHECKS_TOLERATED):
            return False
        node.slow_checks += 1
        logger.warning("prefill node %s answered no health check within %g s (%d in a row); kept in the rotation "
                       "until %d in a row", node.address, self.check_timeout_s, node.slow_checks,
                       SLOW_CHECKS_TOLERATED + 1)
        return True

    @staticmethod
    def _load_of(node: _Node, metadata: grpc.aio.Metadata | None) -> NodeLoad | None:
        """The load report in a check's trailing metadata; None (logged) when it is malformed."""
        try:
            return NodeLoad.from_metadata(metadata)
        except ValueError as exc:
            logger.warning("prefill node %s: %s; counting only this node's picks", node.address, exc)
            return None

    async def _failure_reason(self, node: _Node, exc: grpc.aio.AioRpcError) -> str:
        """Why ``node``'s check failed. A connection closed at once is what a TLS server does to a
        plaintext client (and an mTLS server to a certificate it does not trust): name it."""
        reason = failure_reason(exc, timeout_s=self.check_timeout_s)
        if not closed_at_once(reason):
            return reason
        if self.tls is not None:
            return (f"TLS handshake failed: the prefill node closed the connection ({reason}); does it trust "
                    f"this node's certificate (--tls-cert, --tls-ca)?")
        if node.reason == plaintext_to_tls_reason() or await speaks_tls(node.address):
            return plaintext_to_tls_reason()
        return reason

    def _changed(self) -> None:
        """Wake the requests waiting for a node, and tell ``on_change`` when ``usable`` flipped."""
        usable = self.usable
        if usable:
            self._some_healthy.set()
        else:
            self._some_healthy.clear()
        if usable == self._usable:
            return
        self._usable = usable
        if not usable:
            logger.warning("no prefill node is usable: %s", self.reasons())
        if self.on_change is not None:
            self.on_change(usable)

    async def refresh(self, *, resolve: bool = True) -> None:
        """Re-resolve the targets (unless ``resolve`` is False and some address is known) and check
        every node; one refresh at a time."""
        async with self._refresh_lock:
            addresses = await self._resolve() if resolve or not self._nodes else list(self._nodes)
            for address in list(self._nodes):
                if address not in addresses:
                    node = self._nodes.pop(address)
                    logger.info("prefill node %s is gone from %s", address, self.targets)
                    await node.health_channel.close()
                    self._retire(address)
            for address in addresses:
                if address not in self._nodes:
                    reconnect_ms = max(100, min(MAX_RECONNECT_BACKOFF_MS, int(self.health_interval_s * 1000)))
                    self._nodes[address] = _Node(address, reconnect_ms, self.tls)
            await asyncio.gather(*(self._check(n) for n in list(self._nodes.values())))
            self._changed()  # a node gone from DNS may have been the last usable one
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
        """Every ``health_interval_s``, or sooner (at most every ``KICK_GAP_S``) while requests
        wait for a node; a kicked refresh re-checks the known nodes without re-resolving."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.health_interval_s)
            kicked = self._kick.is_set()
            self._kick.clear()
            with contextlib.suppress(Exception):
                await self.refresh(resolve=not kicked)
            await asyncio.sleep(KICK_GAP_S)

    def _usable_nodes(self) -> list[_Node]:
        return [n for n in self._nodes.values() if n.healthy and n.peer is not None]

    @property
    def usable(self) -> bool:
        """Whether a prefill node is healthy and handshaken now."""
        return bool(self._usable_nodes())

    def healthy(self) -> list[str]:
        return [n.address for n in self._usable_nodes()]

    def reasons(self) -> str:
        """Every node and why it is unusable (``"10.0.0.7:50051: connection refused; ..."``)."""
        unusable = [f"{n.address}: {n.reason or 'not handshaken yet'}" for n in self._nodes.values()
                    if not (n.healthy and n.peer is not None)]
        return "; ".join(unusable) or f"no address resolved for {', '.join(self.targets)}"

    def loads(self) -> dict[str, dict[str, int | None]]:
        """Each usable node's load as this node estimates it (``LoadView.describe``)."""
        return {n.address: n.load.describe() for n in self._usable_nodes()}

    async def pick(self, prompt_tokens: int = 0) -> PrefillPeer:
        """The peer of the healthy node a prompt of ``prompt_tokens`` tokens goes to (by ``policy``); the
        pick counts on that node's load at once. With none healthy, refreshes at once (and every
        ``KICK_GAP_S``) and waits at most ``no_node_wait_s`` for one; then UNAVAILABLE naming every node
        and why it cannot be used."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.no_node_wait_s
        while not (nodes := self._usable_nodes()):
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, f"no prefill node is healthy: {self.reasons()}")
            self._kick.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._some_healthy.wait(), min(remaining, 3 * KICK_GAP_S))
        node = nodes[self.chooser.choose([n.load for n in nodes], prompt_tokens)]
        if self._picks is not None:
            self._picks.labels(node.address).inc()
        return node.peer

    def mark_failed(self, peer: PrefillPeer, reason: str) -> None:
        """Skip the node until a health check passes again (one is due at once)."""
        node = self._nodes.get(peer.address)
        if node is not None and node.healthy:
            node.healthy, node.reason, node.peer = False, reason, None
            node.load.forget()
            logger.warning("prefill node %s failed a call (%s); skipping it until its next health check",
                           peer.address, reason)
            self._changed()
            self._kick.set()
