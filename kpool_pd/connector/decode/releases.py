"""The decode node's background Releases: a grant whose Release could not wait for its answer (its
caller was cancelled, or a failure path) is released here, sent again until the prefill node answers it,
refuses it for good or the grant's lease has run out.

The Releases belong to the decode connector, not to the peer that queued them: a peer closed meanwhile
(disconnected after a failed pull, replaced by a new Handshake with the same node) does not end them.
Each try goes through the peer that queued it while that one is open, else through the newest open peer
of the same address (the node handshaken again); while the address has none, the try fails and the next
follows after the backoff."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import grpc

from kpool_pd.connector.shared.errors import StatusError

logger = logging.getLogger(__name__)

RELEASE_RETRY_S = (0.1, 2.0)  # a background Release that failed is sent again after 0.1 s, doubling up to 2 s
RELEASE_GIVEN_UP = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION,  # sent again, it fails
                    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED,    # the same way
                    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.NOT_FOUND)


class Releaser(Protocol):
    """What a Release goes through: a handshaken prefill node (``PrefillPeer``)."""

    address: str
    closed: bool

    async def release(self, grant_id: str, *, dcp_rank: int = 0, all_ranks: bool = False,
                      timeout_s: float | None = None) -> bool: ...


class BackgroundReleases:
    """The Releases in flight of one decode node. ``peers`` returns the node's open peers, oldest first
    (``DecodeConnector.peers``); ``rpc_timeout_s`` bounds each try. ``close`` (at the connector's
    close) cancels what is left."""

    def __init__(self, peers: Callable[[], Iterable[Releaser]], *, rpc_timeout_s: float) -> None:
        self._peers = peers
        self.rpc_timeout_s = rpc_timeout_s
        self._tasks: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def through(self, queued_on: Releaser) -> Releaser | None:
        """The peer a try goes through now: ``queued_on`` while open, else the newest open peer of its
        address; None while the address has no open peer."""
        if not queued_on.closed:
            return queued_on
        same = [p for p in self._peers() if p.address == queued_on.address and not p.closed]
        return same[-1] if same else None

    def start(self, queued_on: Releaser, grant_id: str, *, lease_s: float, dcp_rank: int = 0,
              all_ranks: bool = False) -> asyncio.Task:
        """Release ``grant_id`` (held by the node at ``queued_on.address``) in a task this object keeps,
        tried until ``lease_s`` from now; the task. Never blocks nor raises."""
        deadline = time.monotonic() + lease_s
        task = asyncio.ensure_future(self._until(queued_on, grant_id, deadline, dcp_rank, all_ranks))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _until(self, queued_on: Releaser, grant_id: str, deadline: float, dcp_rank: int,
                     all_ranks: bool) -> None:
        backoff_s, tries = RELEASE_RETRY_S[0], 1
        while not await self._try(queued_on, grant_id, deadline, tries, backoff_s, dcp_rank, all_ranks):
            await asyncio.sleep(backoff_s)
            backoff_s, tries = min(backoff_s * 2, RELEASE_RETRY_S[1]), tries + 1

    async def _try(self, queued_on: Releaser, grant_id: str, deadline: float, tries: int, backoff_s: float,
                   dcp_rank: int, all_ranks: bool) -> bool:
        """One Release, answered by ``deadline`` at the latest; False when it failed and another try
        may follow in ``backoff_s``. True when it was answered, refused for good (``RELEASE_GIVEN_UP``)
        or the lease ends first; a failure is logged."""
        address = queued_on.address
        timeout_s = min(self.rpc_timeout_s, max(deadline - time.monotonic(), 0.001))
        try:
            peer = self.through(queued_on)
            if peer is None:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, f"no open peer of {address}")
            await peer.release(grant_id, dcp_rank=dcp_rank, all_ranks=all_ranks, timeout_s=timeout_s)
        except StatusError as exc:
            left_s = deadline - time.monotonic()
            if exc.code in RELEASE_GIVEN_UP or left_s <= backoff_s:
                logger.warning("release of %s failed at try %d (%s); its lease will free it", grant_id, tries, exc)
                return True
            log = logger.warning if tries == 1 else logger.debug  # one warning per grant, not one per try
            log("release of %s failed at try %d (%s); trying again in %.1f s, for %.1f s more", grant_id, tries,
                exc, backoff_s, left_s)
            return False
        if tries > 1:
            logger.info("release of %s on %s answered at try %d", grant_id, address, tries)
        return True

    async def close(self) -> None:
        """Cancel the Releases left (idempotent); their grants end with their leases."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
