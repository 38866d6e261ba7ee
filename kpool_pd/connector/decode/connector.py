"""DecodeConnector: the decode node's side of the connector. It owns its UCX worker and its
handshaken prefill nodes (``PrefillPeer``), through which it asks for prefills and pulls them into
allocations its caller made in the node's cache (``kpool_pd.connector.decode.peer``, ``kpool_pd.connector.decode.inbound``): the node's
cache and its allocations are the engine's (its scheduler's), never the connector's.

Every call that waits on a peer has a deadline (``rpc_timeout_s``, ``transfer_timeout_s``);
every failure is a ``StatusError`` carrying a gRPC status code.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

import grpc
import torch
from prometheus_client import CollectorRegistry

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared.channels import open_channel
from kpool_pd.connector.shared.compat import MAX_MODEL_IDENTITY_CHARS, model_differences, peer_layout
from kpool_pd.connector.shared.config import ConnectorConfig, ucx_options_for
from kpool_pd.connector.shared.ucx_progress import progress_mode_for
from kpool_pd.connector.shared.errors import StatusError, rpc_failure
from kpool_pd.connector.shared.metrics import ConnectorMetrics
from kpool_pd.connector.decode.engine_secrets import EngineSecrets
from kpool_pd.connector.decode.peer import PrefillPeer
from kpool_pd.connector.decode.peer_context import PeerContext
from kpool_pd.connector.decode.releases import BackgroundReleases
from kpool_pd.connector.shared.ucx import NOT_ENCRYPTED, ReceiveBatch, UcxNode
from kpool_pd.connector.shared.wire import PROTOCOL_VERSION, Transport, layout_message, protocol_name, transports_from
from kpool_pd.kvcache import CachePool

logger = logging.getLogger(__name__)


class DecodeConnector:
    """The decode node's pool (the bytes it pulls into), its UCX worker, and its peers.

    ``await start()`` (inside the event loop that will run the pulls) makes the UCX worker when
    UCX is among ``transports``; ``connect(address)`` handshakes with one prefill node (each
    call a new channel) and ``disconnect(peer_or_address)`` closes it."""

    def __init__(self, pool: CachePool, *, engine_id: str,
                 config: ConnectorConfig, registry: CollectorRegistry,
                 transports: tuple[Transport, ...] = (Transport.UCX, Transport.GRPC_STREAM),
                 model_identity: str = "") -> None:
        if not isinstance(model_identity, str) or len(model_identity) > MAX_MODEL_IDENTITY_CHARS:
            raise ValueError(f"model_identity must be a string of at most {MAX_MODEL_IDENTITY_CHARS} characters")
        self.pool = pool
        self.engine_id = engine_id
        self.model_identity = model_identity
        self.config = config
        self.transports = tuple(transports)
        self.metrics = ConnectorMetrics(registry, "decode")
        self.ucx: UcxNode | None = None
        self.secrets = EngineSecrets()  # this engine's secret on each prefill node (its Handshakes')
        self._peers: list[PrefillPeer] = []
        self.releases = BackgroundReleases(lambda: self._peers, rpc_timeout_s=config.rpc_timeout_s)

    async def start(self) -> "DecodeConnector":
        """Make the UCX worker when UCX is among ``transports`` (idempotent); returns self."""
        if Transport.UCX in self.transports and self.ucx is None:
            self.ucx = UcxNode(ucx_options_for(self.config.ucx_options, self.pool.device.type),
                               progress_mode=progress_mode_for(self.config.ucx_progress, self.pool.device.type))
            if self.config.tls is not None:
                logger.warning(NOT_ENCRYPTED)
        return self

    @property
    def peers(self) -> tuple[PrefillPeer, ...]:
        """The connected peers, oldest first."""
        return tuple(self._peers)

    async def connect(self, address: str) -> PrefillPeer:
        """Handshake with the prefill node at ``host:port``. FAILED_PRECONDITION when the layouts
        differ in more than their arrangement (block size, order, kernel page; naming the fields), the model identities
        differ (naming what differs) or the node speaks another connector protocol version (naming both); UNAUTHENTICATED without the right token, on either side: with ``peer_token`` the
        channel's first call proves it through PeerAuth, and a node that does not prove it back is sent
        nothing else (``open_channel``); INVALID_ARGUMENT or UNAVAILABLE
        when the prefill node refuses or cannot reach our UCX worker address. Each call opens a new
        channel: a caller that handshakes again with the same node calls ``disconnect`` first. On any
        failure the channel is closed before this returns, and no peer (nor its keep-alive) is kept.

        The peer keeps itself alive (``PrefillPeer.keep_alive``): Heartbeats that renew the grants it is
        pulling, and a new Handshake on the same channel when the prefill node says it forgot this engine
        (after a long silence); this ends when the peer is closed."""
        channel = open_channel(address, self.config.tls, self.config.grpc_options(), peer_token=self.config.peer_token,
                               challenge_timeout_s=self.config.rpc_timeout_s)
        req = pb.HandshakeRequest(engine_id=self.engine_id, layout=layout_message(self.pool.layout),
                                  transports=[t.value for t in self.transports if t is not Transport.UCX or self.ucx],
                                  ucx_worker_address=self.ucx.address if self.ucx else b"",
                                  model_identity=self.model_identity, engine_secret=self.secrets.get(address),
                                  protocol_version=PROTOCOL_VERSION)
        stub = pb.PrefillServiceStub(channel)
        warmup = self._post_warmup(req)
        try:
            r = await stub.Handshake(req, timeout=self.config.rpc_timeout_s)
            if Transport.UCX in transports_from(r.transports):
                await self._await_warmup(warmup, address)
        except grpc.aio.AioRpcError as exc:
            await self._retire(warmup)
            await channel.close()
            self.metrics.failures.labels(exc.code().name.lower()).inc()
            raise rpc_failure(exc, f"Handshake with {address}") from None
        except BaseException:
            await self._retire(warmup)
            await channel.close()
            raise
        await self._retire(warmup)  # still posted when the prefill node took no UCX (and sent nothing)
        req.ucx_warmup_tag = 0  # the keep-alive's Handshakes reuse the endpoint: no warm-up message
        self.secrets.keep(address, r.engine_secret)
        layout, differing = peer_layout(self.pool.layout, r.layout)
        model = model_differences(self.model_identity, r.model_identity)
        if layout is None or model or r.protocol_version != PROTOCOL_VERSION:
            await channel.close()
            cause = "layout_mismatch" if layout is None else "model_mismatch" if model else "protocol_mismatch"
            self.metrics.failures.labels(cause).inc()
            what = (f"cache layout of prefill node {r.engine_id} differs: fields {differing}" if layout is None else
                    f"model differs (this engine vs prefill node {r.engine_id}): {'; '.join(model)}" if model else
                    f"prefill node {r.engine_id} speaks {protocol_name(r.protocol_version)}; this engine speaks "
                    f"{protocol_name(PROTOCOL_VERSION)}")
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"Handshake with {address}: {what}")
        peer = PrefillPeer(self.peer_context(), address, channel, r, layout, handshake=req)
        self._peers.append(peer)
        return peer

    def peer_context(self) -> PeerContext:
        """What this node's peers need of it (its UCX worker as ``start`` made it)."""
        return PeerContext(pool=self.pool, engine_id=self.engine_id, config=self.config, metrics=self.metrics,
                           ucx=self.ucx, secrets=self.secrets, releases=self.releases)

    def _post_warmup(self, req: pb.HandshakeRequest) -> ReceiveBatch | None:
        """With UCX: draw the Handshake's warm-up tag and post its (empty) receive."""
        if self.ucx is None:
            return None
        req.ucx_warmup_tag = secrets.randbits(64) | 1
        return self.ucx.post_receives([torch.empty(0, dtype=torch.uint8)], req.ucx_warmup_tag)

    async def _await_warmup(self, warmup: ReceiveBatch | None, address: str) -> None:
        """The prefill node's warm-up message arrived (its UCX endpoint to us works), within
        ``rpc_timeout_s``; UNAVAILABLE otherwise. Only for a prefill node that offers UCX (one that
        does not sends none)."""
        if warmup is None:
            return
        try:
            await asyncio.wait_for(warmup.wait(), self.config.rpc_timeout_s)
        except asyncio.TimeoutError:
            self.metrics.failures.labels("ucx_warmup").inc()
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"Handshake with {address}: the prefill node's UCX warm-up "
                              f"message did not arrive within {self.config.rpc_timeout_s} s") from None

    async def _retire(self, warmup: ReceiveBatch | None) -> None:
        if warmup is not None and warmup.pending():
            await self.ucx.abandon(warmup)

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
        worker. Requests already landed keep their blocks until released; background Releases still
        going on are cancelled (their grants end with their leases)."""
        await self.releases.close()
        for peer in self._peers:
            await peer.close()
        self._peers.clear()
        if self.ucx is not None:
            self.ucx.close()
