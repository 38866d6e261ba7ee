"""The UCX data plane on ucxx: this process's worker, endpoints made from peers' worker addresses
(exchanged in the Handshake), and tag-matched sends and receives.

Only the sending side (the prefill node) makes endpoints; the decode node posts its receives on
its worker and holds no endpoint to a prefill node. UCX pairs the endpoints that two workers
make to each other by connection sequence number; when the receiving side drops its half of such
a pair while the sender keeps the other, the sender's later rendezvous messages find no endpoint
to answer them and large transfers fail or hang. With endpoints on one side only, either side
may fail, drop or restart without the other noticing: a sender that drops its endpoint makes a
fresh one (UCX wires it up anew), and the receiver has nothing to drop.

Endpoint error handling is off, so that UCX may use shared memory; peer failure is the control
plane's job (deadlines, leases, heartbeats). Messages are tag-matched with ``force_tag``: region
i of a pull travels under ``tag_base + i``, where the decode node draws ``tag_base`` at random for
each pull.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import numpy as np
import torch

from connector.regions import ucx_buffer

logger = logging.getLogger(__name__)

MAX_REGIONS = 1 << 16  # region index fits in the low 16 bits of the tag
TAG_MASK = (1 << 64) - 1
ABANDON_GRACE_S = 1.0  # how long abandoned receives may take to settle before their memory is reused


class UcxUnavailableError(RuntimeError):
    """ucxx cannot be imported or initialised; deploy with the gRPC stream transport instead."""


def _import_ucxx():
    try:
        import ucxx
    except Exception as exc:  # ImportError, or a missing libucx
        raise UcxUnavailableError(
            f"the UCX transport needs the ucxx package (pip install 'kpool-pd[ucx]'): {exc}; "
            "choose the gRPC stream transport on machines without UCX") from exc
    return ucxx


def ucx_available() -> bool:
    try:
        _import_ucxx()
    except UcxUnavailableError:
        return False
    return True


def region_tag(tag_base: int, index: int) -> int:
    return (tag_base + index) & TAG_MASK


class ReceiveBatch:
    """The receives of one pull, posted on the worker: ``futures[i]`` completes when region i
    (tag ``tags[i]``) landed."""

    __slots__ = ("tags", "futures")

    def __init__(self, tags: list[int], futures: list[asyncio.Future]) -> None:
        self.tags, self.futures = tags, futures

    def pending(self) -> list[int]:
        """Indexes of the receives that have not completed."""
        return [i for i, f in enumerate(self.futures) if not f.done()]

    async def wait(self) -> None:
        """Until every region landed; raises the first receive's error. Cancelling the wait
        leaves the receives posted (``UcxNode.abandon`` retires them)."""
        await asyncio.gather(*(asyncio.shield(f) for f in self.futures))


class UcxNode:
    """The process's ucxx worker (ucxx keeps one per process) and our endpoints to the peers we
    send to. Create it inside the running event loop that will await its transfers.

    Sender side: ``remember`` a peer's worker address, ``send`` to it; a failed or cancelled send
    drops the endpoint it used (cancelling its requests) and the next send makes a fresh one.
    Receiver side: ``post_receives`` on the worker, and ``abandon`` the receives of a pull that
    failed, so that nothing lands in its memory once it is reused.
    """

    def __init__(self, options: Sequence[tuple[str, str]] = ()) -> None:
        self._ucxx = _import_ucxx()
        try:  # an operator's UCX_<KEY> in the environment overrides our option <KEY>
            self._ucxx.init(options=dict(options), env_takes_precedence=True)
        except RuntimeError:
            logger.info("ucxx already initialised in this process; keeping its options")
        self.address: bytes = bytes(self._ucxx.get_worker_address())
        self._addresses: dict[str, bytes] = {}
        self._endpoints: dict[str, object] = {}
        self._lock = asyncio.Lock()
        self._self_endpoint = None

    def active_transports(self) -> frozenset[str]:
        """The UCX transports this process's context uses (e.g. {"tcp", "self", "sysv"})."""
        return frozenset(self._ucxx.get_active_transports())

    def ucx_config(self) -> dict[str, str]:
        """UCX's context configuration as UCX reports it (keys without the ``UCX_`` prefix)."""
        return dict(self._ucxx.get_config())

    # sender side -------------------------------------------------------------------------
    def remember(self, peer: str, address: bytes) -> None:
        """Record a peer's worker address (from the Handshake); drop an endpoint to an older one."""
        if self._addresses.get(peer) != address:
            self.drop(peer, reason="the peer's worker address changed")
            self._addresses[peer] = address

    def knows(self, peer: str) -> bool:
        return peer in self._addresses

    def forget(self, peer: str) -> None:
        """Drop the endpoint to ``peer`` and its recorded worker address (idempotent)."""
        self.drop(peer)
        self._addresses.pop(peer, None)

    async def endpoint(self, peer: str):
        async with self._lock:
            ep = self._endpoints.get(peer)
            if ep is None:
                if peer not in self._addresses:
                    raise KeyError(f"no UCX worker address for peer {peer!r}; it must handshake first")
                address = self._ucxx.get_ucx_address_from_buffer(self._addresses[peer])
                ep = await self._ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=False)
                self._endpoints[peer] = ep
            return ep

    def drop(self, peer: str, endpoint=None, *, reason: str = "") -> bool:
        """Abort the endpoint to ``peer`` (idempotent), cancelling its requests in flight. With
        ``endpoint``, only if that is still the current one (a newer one is left alone). A
        ``reason`` is logged as a warning."""
        ep = self._endpoints.get(peer)
        if ep is None or (endpoint is not None and ep is not endpoint):
            return False
        del self._endpoints[peer]
        if reason:
            logger.warning("aborting UCX endpoint to %s (%s); its sends in flight are cancelled", peer, reason)
        ep.abort(period=10**9)
        return True

    async def send(self, peer: str, views: Sequence[torch.Tensor], tag_base: int) -> None:
        """Send ``views[i]`` under ``tag_base + i``, all at once; returns when all completed.
        On any failure or cancellation the endpoint used is dropped, so that no send keeps
        reading ``views`` afterwards."""
        ep = await self.endpoint(peer)
        try:
            await asyncio.gather(*(ep.send(ucx_buffer(v), tag=region_tag(tag_base, i), force_tag=True)
                                   for i, v in enumerate(views)))
        except BaseException as exc:
            self.drop(peer, ep, reason=f"a send failed: {type(exc).__name__}")
            raise

    # receiver side -----------------------------------------------------------------------
    def post_receives(self, views: Sequence[torch.Tensor], tag_base: int) -> ReceiveBatch:
        """Post ``views[i]`` as the receive buffer for ``tag_base + i`` on the worker."""
        tags = [region_tag(tag_base, i) for i in range(len(views))]
        return ReceiveBatch(tags, [asyncio.ensure_future(self._ucxx.recv(ucx_buffer(v), tag))
                                   for v, tag in zip(views, tags)])

    async def abandon(self, batch: ReceiveBatch, grace_s: float = ABANDON_GRACE_S) -> int:
        """Retire the receives of a failed pull before their memory is reused.

        A receive that no message matched yet is completed by a one-byte message that this
        worker sends itself under its tag (the sender's message, should it still come, then
        waits unmatched and is never delivered). A receive already matched by the sender's
        message completes or fails when the sender finishes or aborts; this waits ``grace_s``
        for those. Returns how many receives are still pending (a dead sender's, which nothing
        will write any more)."""
        pending = batch.pending()
        if not pending:
            return 0
        ep = await self._loopback()
        one = np.zeros(1, dtype=np.uint8)
        await asyncio.gather(*(ep.send(one, tag=batch.tags[i], force_tag=True) for i in pending),
                             return_exceptions=True)
        futures = [batch.futures[i] for i in pending]
        _, still = await asyncio.wait(futures, timeout=grace_s)
        for future in futures:  # retrieve the exceptions of cancelled and failed receives
            if future.done() and not future.cancelled():
                future.exception()
        return len(still)

    async def _loopback(self):
        async with self._lock:
            if self._self_endpoint is None:
                self._self_endpoint = await self._ucxx.create_endpoint_from_worker_address(
                    self._ucxx.get_ucx_address_from_buffer(self.address), endpoint_error_handling=False)
            return self._self_endpoint

    def close(self) -> None:
        for peer in list(self._endpoints):
            self.drop(peer)
        if self._self_endpoint is not None:
            self._self_endpoint.abort(period=10**9)
            self._self_endpoint = None
