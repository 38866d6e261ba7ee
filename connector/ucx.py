"""The UCX data plane on ucxx: this process's worker, and endpoints made from peers' worker
addresses (exchanged in the Handshake) with endpoint error handling off, so that UCX may use
shared memory; peer failure is the control plane's job (deadlines, leases, heartbeats).

Messages are tag-matched with ``force_tag``: region i of a pull travels under ``tag_base + i``,
where the decode node draws ``tag_base`` at random for each pull.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch

from connector.regions import ucx_buffer

logger = logging.getLogger(__name__)

MAX_REGIONS = 1 << 16  # region index fits in the low 16 bits of the tag
TAG_MASK = (1 << 64) - 1


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


class UcxNode:
    """The process's ucxx worker (ucxx keeps one per process) and our endpoints to peers.

    Create it inside the running event loop that will await its transfers. ``drop(peer)`` aborts
    the endpoint, which cancels every send and receive in flight through it (their awaits raise);
    the next ``endpoint(peer)`` makes a fresh one.
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

    def remember(self, peer: str, address: bytes) -> None:
        """Record a peer's worker address (from the Handshake); drop an endpoint to an older one."""
        if self._addresses.get(peer) != address:
            self.drop(peer)
            self._addresses[peer] = address

    def knows(self, peer: str) -> bool:
        return peer in self._addresses

    def active_transports(self) -> frozenset[str]:
        """The UCX transports this process's context uses (e.g. {"tcp", "self", "sysv"})."""
        return frozenset(self._ucxx.get_active_transports())

    def ucx_config(self) -> dict[str, str]:
        """UCX's context configuration as UCX reports it (keys without the ``UCX_`` prefix)."""
        return dict(self._ucxx.get_config())

    def forget(self, peer: str) -> None:
        """Drop the endpoint to ``peer`` and its recorded worker address (idempotent); the peer
        must handshake again before the next transfer with it."""
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

    def drop(self, peer: str) -> None:
        """Abort the endpoint to ``peer`` (idempotent), cancelling its requests in flight."""
        ep = self._endpoints.pop(peer, None)
        if ep is not None:
            logger.warning("aborting UCX endpoint to %s (cancels its transfers in flight)", peer)
            ep.abort(period=10**9)

    async def send(self, peer: str, views: Sequence[torch.Tensor], tag_base: int) -> None:
        """Send ``views[i]`` under ``tag_base + i``, all at once; returns when all completed."""
        ep = await self.endpoint(peer)
        await asyncio.gather(*(ep.send(ucx_buffer(v), tag=region_tag(tag_base, i), force_tag=True)
                               for i, v in enumerate(views)))

    async def post_receives(self, peer: str, views: Sequence[torch.Tensor], tag_base: int) -> list[asyncio.Future]:
        """Post ``views[i]`` as the receive buffer for ``tag_base + i`` through the endpoint to
        ``peer`` (so that dropping it cancels them). The futures complete when the bytes landed."""
        ep = await self.endpoint(peer)
        return [asyncio.ensure_future(ep.recv(ucx_buffer(v), tag=region_tag(tag_base, i), force_tag=True))
                for i, v in enumerate(views)]

    def close(self) -> None:
        for peer in list(self._endpoints):
            self.drop(peer)
