"""The Handshake RPC on the prefill node: a decode engine's id, layout, model and UCX worker address
checked, the address vetted and reached, then (only if all pass) the engine's record replaced whole.

A Handshake checks everything it is given before it changes anything: a refused one leaves the engine's
earlier record (its transports, UCX address and endpoints) as it was. A UCX worker address reaches UCX in
this process only after ``UcxNode.vet`` (its bytes checked, then a first endpoint made in a child process).
A re-handshake from the same worker address keeps the link and its endpoints (the keep-alive's do); one
from another address gets a new link, and the old one is closed once the new record is in place.

An engine id is claimed by its first Handshake, which returns the engine's secret; a Handshake naming a
known engine is checked first of all: without that secret it is refused PERMISSION_DENIED and nothing
about the engine changes (``DecodeEngineTable.secret_for``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.prefill.decode_engines import MAX_ID_CHARS, DecodeEngine, DecodeEngineTable
from kpool_pd.connector.prefill.ucx_address import WorkerAddressError
from kpool_pd.connector.prefill.ucx_link import UcxLink
from kpool_pd.connector.prefill.ucx_vetting import AddressVetting
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.connector.shared.compat import MAX_MODEL_IDENTITY_CHARS, arrangement, model_differences, peer_layout
from kpool_pd.connector.shared.config import ConnectorConfig
from kpool_pd.connector.shared.metrics import ConnectorMetrics
from kpool_pd.connector.shared.ucx import UcxNode
from kpool_pd.connector.shared.wire import PROTOCOL_VERSION, Transport, layout_message, protocol_name, transports_from
from kpool_pd.kvcache import BlockLayout

logger = logging.getLogger(__name__)

VET_SHARE = 0.75  # of rpc_timeout_s, what vetting a new UCX worker address may take


class HandshakeDesk:
    """Answers Handshakes for the prefill node ``engine_id`` and admits the engines that pass into
    ``engines``. ``ucx`` is the node's UCX worker once the connector started, ``vetting`` what checks a
    decode engine's worker address before an endpoint is made to it (both None without UCX)."""

    def __init__(self, *, engine_id: str, layout: BlockLayout, model_identity: str, config: ConnectorConfig,
                 transports: tuple[Transport, ...], engines: DecodeEngineTable, metrics: ConnectorMetrics) -> None:
        self.engine_id, self.layout, self.model_identity = engine_id, layout, model_identity
        self.config, self.transports, self.engines, self.metrics = config, transports, engines, metrics
        self.ucx: UcxNode | None = None
        self.vetting: AddressVetting | None = None

    async def answer(self, request: pb.HandshakeRequest, context) -> pb.HandshakeResponse:
        """Check the decode engine's id, layout, model and UCX worker address, then (only if all pass)
        admit its new record. INVALID_ARGUMENT for a malformed id or address, PERMISSION_DENIED for a known
        engine's id without its secret, FAILED_PRECONDITION for a layout, model or protocol version mismatch, UNAVAILABLE when
        UCX cannot reach the address; a refusal is logged as a warning and changes nothing about the engine."""
        engine_id = request.engine_id
        if not engine_id or len(engine_id) > MAX_ID_CHARS:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_engine_id", engine_id[:MAX_ID_CHARS],
                               f"engine_id must have 1 to {MAX_ID_CHARS} characters")
        try:
            secret = self.engines.secret_for(engine_id, request.engine_secret)
        except StatusError as exc:
            await self._refuse(context, exc.code, "engine_claimed", engine_id, exc.message)
        theirs, differing = peer_layout(self.layout, request.layout)
        if theirs is None:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "layout_mismatch", engine_id,
                               f"cache layout differs from prefill node {self.engine_id}: fields {differing}")
        if len(request.model_identity) > MAX_MODEL_IDENTITY_CHARS:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_model_identity", engine_id,
                               f"model_identity has {len(request.model_identity)} characters "
                               f"(limit {MAX_MODEL_IDENTITY_CHARS})")
        model = model_differences(self.model_identity, request.model_identity)
        if model:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "model_mismatch", engine_id,
                               f"model differs (prefill node {self.engine_id} vs engine {engine_id}): {'; '.join(model)}")
        if request.protocol_version != PROTOCOL_VERSION:
            await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "protocol_mismatch", engine_id,
                               f"engine {engine_id} speaks {protocol_name(request.protocol_version)}; prefill node "
                               f"{self.engine_id} speaks {protocol_name(PROTOCOL_VERSION)}")
        offered = frozenset(transports_from(request.transports))
        if Transport.UCX in offered and self.ucx is None:
            offered -= {Transport.UCX}  # this node sends over the gRPC stream only
        link = None
        if Transport.UCX in offered:
            link = await self._reach(context, engine_id, request.ucx_worker_address, request.ucx_warmup_tag)
        if differing:
            logger.info("engine %s stores %s, this node %s; it converts what it pulls", engine_id,
                        arrangement(theirs), arrangement(self.layout))
        known = self.engines.get(engine_id)
        try:
            self.engines.admit(DecodeEngine(engine_id, offered, link, secret))
        except StatusError as exc:  # another claim of the id won while this one reached its address
            if link is not None and (known is None or link is not known.link):
                link.close()
            await self._refuse(context, exc.code, "engine_claimed", engine_id, exc.message)
        return pb.HandshakeResponse(
            engine_id=self.engine_id, layout=layout_message(self.layout),
            transports=[t.value for t in self.transports],
            ucx_worker_address=self.ucx.address if self.ucx is not None else b"",
            lease_ms=int(self.config.lease_s * 1000), max_prompt_tokens=self.config.max_prompt_tokens,
            chunk_bytes=self.config.chunk_bytes, model_identity=self.model_identity, pull_session=True,
            engine_secret=secret, pull_session_idle_ms=int(self.config.pull_session_idle_s * 1000),
            protocol_version=PROTOCOL_VERSION, push=self.layout.num_groups == 1,
            piece_tokens=self.config.piece_tokens, pull_batches=True,
        )

    async def _reach(self, context, engine_id: str, address: bytes, warmup_tag: int) -> UcxLink:
        """The link to ``engine_id`` at ``address``: the engine's own when it already is at that address,
        else a new one (vetted, its first endpoint made); then (``warmup_tag`` nonzero) the empty warm-up
        message sent through it. Aborts the Handshake otherwise, closing a new link (the engine's record
        untouched)."""
        if not address:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "ucx_address", engine_id,
                               "UCX offered without a ucx_worker_address")
        known = self.engines.get(engine_id)
        link = known.link if known is not None and known.ucx_address == bytes(address) and known.link.endpoints \
            else None
        made = None
        started = time.monotonic()
        try:
            if link is None:
                await self.vetting.vet(address, VET_SHARE * self.config.rpc_timeout_s)
                left = max(self.config.rpc_timeout_s - (time.monotonic() - started), 0.1)
                link = made = await asyncio.wait_for(UcxLink.open(self.ucx, engine_id, address), left)
            if warmup_tag:
                left = max(self.config.rpc_timeout_s - (time.monotonic() - started), 0.1)
                await asyncio.wait_for(link.warm_up(warmup_tag), left)
        except BaseException as exc:
            if made is not None:
                made.close()
            if isinstance(exc, WorkerAddressError):
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "ucx_address", engine_id,
                                   f"ucx_worker_address refused: {exc}")
            if isinstance(exc, Exception):  # UcxUnreachableError, a time-out, or UCX's own error
                await self._refuse(context, grpc.StatusCode.UNAVAILABLE, "ucx_unreachable", engine_id,
                                   f"cannot make a UCX endpoint to engine {engine_id}: {type(exc).__name__}: {exc}")
            raise
        return link

    async def _refuse(self, context, code: grpc.StatusCode, cause: str, engine_id: str, message: str) -> None:
        """Count, log (a warning naming the engine and why) and abort a Handshake."""
        self.metrics.failures.labels(cause).inc()
        logger.warning("handshake of engine %r refused (%s): %s", engine_id, code.name, message)
        await context.abort(code, message)
