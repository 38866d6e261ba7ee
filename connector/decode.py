"""DecodeConnector: the decode node's side of the connector. It owns the node's pool and
allocators, its UCX worker, and its handshaken prefill nodes (``PrefillPeer``), through which it
asks for prefills and pulls them into its own blocks (``connector.peer``, ``connector.pull``).

Every call that waits on a peer has a deadline (``rpc_timeout_s``, ``transfer_timeout_s``);
every failure is a ``StatusError`` carrying a gRPC status code, and leaves nothing allocated.
"""

from __future__ import annotations

import logging

import grpc
from prometheus_client import CollectorRegistry

from connector import prefill_api as pb
from connector.auth import auth_metadata
from connector.channels import open_channel
from connector.compat import peer_layout
from connector.config import ConnectorConfig
from connector.errors import StatusError, rpc_failure
from connector.metrics import ConnectorMetrics
from connector.peer import PrefillPeer
from connector.ucx import UcxNode
from connector.wire import Transport, layout_message
from kvcache import BlockAllocator, CachePool, RingAllocator

logger = logging.getLogger(__name__)


class DecodeConnector:
    """The decode node's pool and allocators, its UCX worker, and its peers.

    ``await start()`` (inside the event loop that will run the pulls) makes the UCX worker when
    UCX is among ``transports``; ``connect(address)`` handshakes with one prefill node (each
    call a new channel) and ``disconnect(peer_or_address)`` closes it."""

    def __init__(self, pool: CachePool, blocks: BlockAllocator, rings: RingAllocator, *, engine_id: str,
                 config: ConnectorConfig, registry: CollectorRegistry,
                 transports: tuple[Transport, ...] = (Transport.UCX, Transport.GRPC_STREAM)) -> None:
        self.pool, self.blocks, self.rings = pool, blocks, rings
        self.engine_id = engine_id
        self.config = config
        self.transports = tuple(transports)
        self.metrics = ConnectorMetrics(registry, "decode")
        self.metrics.watch_free(lambda: blocks.num_free, lambda: rings.num_free)
        self.ucx: UcxNode | None = None
        self._peers: list[PrefillPeer] = []

    async def start(self) -> "DecodeConnector":
        """Make the UCX worker when UCX is among ``transports`` (idempotent); returns self."""
        if Transport.UCX in self.transports and self.ucx is None:
            self.ucx = UcxNode(self.config.ucx_options)
        return self

    @property
    def peers(self) -> tuple[PrefillPeer, ...]:
        """The connected peers, oldest first."""
        return tuple(self._peers)

    async def connect(self, address: str) -> PrefillPeer:
        """Handshake with the prefill node at ``host:port``. FAILED_PRECONDITION (naming the
        differing layout fields) when the layouts differ in more than ``order``; UNAUTHENTICATED
        without the right token. Each call opens a new channel: a caller that handshakes again
        with the same node calls ``disconnect`` first."""
        channel = open_channel(address, self.config.tls, self.config.grpc_options())
        req = pb.HandshakeRequest(engine_id=self.engine_id, layout=layout_message(self.pool.layout),
                                  transports=[t.value for t in self.transports if t is not Transport.UCX or self.ucx],
                                  ucx_worker_address=self.ucx.address if self.ucx else b"")
        try:
            r = await pb.PrefillServiceStub(channel).Handshake(
                req, timeout=self.config.rpc_timeout_s, metadata=auth_metadata(self.config.bearer_token))
        except grpc.aio.AioRpcError as exc:
            await channel.close()
            self.metrics.failures.labels(exc.code().name.lower()).inc()
            raise rpc_failure(exc, f"Handshake with {address}") from None
        layout, differing = peer_layout(self.pool.layout, r.layout)
        if layout is None:
            await channel.close()
            self.metrics.failures.labels("layout_mismatch").inc()
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"Handshake with {address}: cache layout of prefill node {r.engine_id} differs: fields {differing}")
        peer = PrefillPeer(self, address, channel, r, layout)
        self._peers.append(peer)
        return peer

    async def disconnect(self, peer_or_address: PrefillPeer | str) -> int:
        """Forget a peer, or every peer connected to an address: close its channel (pulls in
        flight on it fail and free their blocks). A router calls it for a node gone from DNS or
        replaced by a new handshake, once ``peer.busy`` is False. Idempotent: returns how many
        peers it closed (0 when none was connected)."""
        if isinstance(peer_or_address, PrefillPeer):
            gone = [p for p in self._peers if p is peer_or_address]
        elif isinstance(peer_or_address, str):
            gone = [p for p in self._peers if p.address == peer_or_address]
        else:
            raise TypeError(f"disconnect takes a PrefillPeer or a 'host:port' string, got {type(peer_or_address).__name__}")
        self._peers = [p for p in self._peers if all(p is not g for g in gone)]
        for peer in gone:
            await peer.close()
        if gone:
            logger.info("disconnected from %s (%d channel%s)", peer_or_address if isinstance(peer_or_address, str)
                        else peer_or_address.address, len(gone), "" if len(gone) == 1 else "s")
        return len(gone)

    async def close(self) -> None:
        """At shutdown: close every peer's channel (calls in flight on them fail) and the UCX
        worker. Requests already landed keep their blocks until released."""
        for peer in self._peers:
            await peer.close()
        self._peers.clear()
        if self.ucx is not None:
            self.ucx.close()
