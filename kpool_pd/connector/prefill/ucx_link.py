"""The prefill node's UCX link to one decode engine: the engine's vetted worker address and the endpoints
made to it, each lent to one pull at a time.

A pull sends on an endpoint lent to it alone (``UcxLink.lend``), so that aborting it, which is how a
pull's sends in flight are stopped, stops no other pull's to the same engine. A pull whose sends all
completed gives its endpoint back: pulls one after the other keep using the endpoint the Handshake made
and warmed up; concurrent pulls make one each, once (UCX wires a new endpoint up on its first message).
The link belongs to the engine's record (``kpool_pd.connector.prefill.decode_engines``): forgetting the engine,
or a Handshake that names another address, closes it, aborting every endpoint, lent or not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import torch

from kpool_pd.connector.shared.ucx import UcxNode, UcxSendError

logger = logging.getLogger(__name__)


class LentEndpoint:
    """An endpoint of ``link`` lent to one pull (``UcxLink.lend``): no other pull sends on it while it is
    lent, so ``abort`` stops this pull's sends in flight and no other's. The pull ends the loan once,
    with ``abort`` (a send may still run) or ``give_back`` (none runs: a later pull may use it); later
    calls of either do nothing, and ``endpoint`` is None from then on."""

    __slots__ = ("link", "endpoint")

    def __init__(self, link: "UcxLink", endpoint) -> None:
        self.link, self.endpoint = link, endpoint

    async def send(self, views: Sequence[torch.Tensor], tag_base: int) -> None:
        """Send ``views[i]`` under ``tag_base + i`` on this endpoint; returns when all completed. On any
        failure or cancellation the endpoint is aborted (its pull's sends alone stop) and the link notes
        when (``send_failed_at``); a failure in UCX is raised as ``UcxSendError``."""
        link = self.link
        try:
            await link.node.send_on(self.endpoint, views, tag_base, peer=link.engine_id)
        except BaseException as exc:
            link.send_failed_at = time.monotonic()
            self.abort(reason=f"a send failed: {type(exc).__name__}")
            raise
        link.send_failed_at = None

    def post(self, view: torch.Tensor, tag: int) -> asyncio.Future:
        """Post the send of ``view`` under ``tag`` on this endpoint now (``UcxNode.post_send``: UCX has the
        message when this returns) and return its completion's future. A failure (here, or of the future)
        aborts the endpoint and notes when (``send_failed_at``), as ``send``; UcxSendError."""
        link = self.link
        try:
            sent = link.node.post_send(self.endpoint, view, tag, peer=link.engine_id)
        except BaseException as exc:
            self._failed(exc)
            raise
        sent.add_done_callback(self._settled)
        return sent

    def _settled(self, sent: asyncio.Future) -> None:
        if sent.cancelled():
            return  # the pull ended: its ``stop_sends`` aborted or gave back the endpoint
        if sent.exception() is not None:
            self._failed(sent.exception())
        else:
            self.link.send_failed_at = None

    def _failed(self, exc: BaseException) -> None:
        self.link.send_failed_at = time.monotonic()
        self.abort(reason=f"a send failed: {type(exc).__name__}")

    def abort(self, reason: str = "") -> bool:
        """Abort the endpoint now, cancelling its requests in flight: once this returns no send on it
        reads its buffers. False if the loan had ended, or the link was closed (which aborted it)."""
        ep, self.endpoint = self.endpoint, None
        return ep is not None and self.link._abort(ep, reason)

    def give_back(self) -> None:
        """End the loan with no send running: the endpoint serves a later pull (unless the link closed)."""
        ep, self.endpoint = self.endpoint, None
        if ep is not None:
            self.link._give_back(ep)

    def __repr__(self) -> str:
        return f"LentEndpoint(engine={self.link.engine_id!r}, lent={self.endpoint is not None})"


class UcxLink:
    """The endpoints to one decode engine's worker ``address`` (vetted: ``UcxNode.vet``). Made by ``open``
    with its first endpoint; ``lend`` an endpoint to each pull; ``close`` aborts them all. Not
    thread-safe: the node's event loop only."""

    __slots__ = ("node", "engine_id", "address", "send_failed_at", "_endpoints", "_idle", "_closed")

    def __init__(self, node: UcxNode, engine_id: str, address: bytes) -> None:
        self.node, self.engine_id, self.address = node, engine_id, bytes(address)
        self.send_failed_at: float | None = None  # when (monotonic) the last send failed, if none succeeded since
        self._endpoints: list = []  # lent or idle
        self._idle: list = []  # no pull holds these
        self._closed = False

    @classmethod
    async def open(cls, node: UcxNode, engine_id: str, address: bytes) -> "UcxLink":
        """A link to ``engine_id`` at a vetted ``address``, with its first endpoint made; the error of UCX
        (or a cancellation) propagates, and nothing is left open."""
        link = cls(node, engine_id, address)
        ep = await node.endpoint_to(link.address)
        link._endpoints.append(ep)
        link._idle.append(ep)
        return link

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def endpoints(self) -> tuple:
        """The endpoints made to the engine and not aborted, lent or idle."""
        return tuple(self._endpoints)

    async def lend(self) -> LentEndpoint:
        """An endpoint for one pull's sends alone: one that no pull holds, else a new one. UcxSendError
        on a closed link (the engine was forgotten or handshook with another address meanwhile)."""
        if self._closed:
            raise UcxSendError(f"UCX link to {self.engine_id} closed: the engine must handshake again")
        if self._idle:
            return LentEndpoint(self, self._idle.pop())
        ep = await self.node.endpoint_to(self.address)
        if self._closed:  # closed while the endpoint was made
            ep.abort(period=10**9)
            raise UcxSendError(f"UCX link to {self.engine_id} closed: the engine must handshake again")
        self._endpoints.append(ep)
        return LentEndpoint(self, ep)

    async def warm_up(self, tag: int) -> None:
        """Send an empty message under ``tag`` on an idle endpoint (UCX wires an endpoint up on its first
        message, so the first pull does not pay for it). Fails as ``LentEndpoint.send`` does."""
        lent = await self.lend()
        try:
            await lent.send([torch.empty(0, dtype=torch.uint8)], tag)
        finally:
            lent.give_back()

    def close(self, reason: str = "") -> None:
        """Abort every endpoint, lent or not, cancelling their sends in flight (idempotent). A ``reason``
        is logged as a warning."""
        self._closed = True
        endpoints, self._endpoints, self._idle = self._endpoints, [], []
        if endpoints and reason:
            logger.warning("aborting UCX endpoints to %s (%s); their sends in flight are cancelled",
                           self.engine_id, reason)
        for ep in endpoints:
            ep.abort(period=10**9)

    def _abort(self, ep, reason: str) -> bool:
        if ep not in self._endpoints:
            return False
        self._endpoints.remove(ep)
        if reason:
            logger.warning("aborting a UCX endpoint to %s (%s); its sends in flight are cancelled", self.engine_id,
                           reason)
        ep.abort(period=10**9)
        return True

    def _give_back(self, ep) -> None:
        if ep in self._endpoints:  # not aborted by ``close`` meanwhile
            self._idle.append(ep)

    def __repr__(self) -> str:
        return (f"UcxLink({self.engine_id!r}, {len(self._endpoints)} endpoints, {len(self._idle)} idle"
                f"{', closed' if self._closed else ''})")
