"""How rank 0 of a DCP decode instance fetches a request and steps its batch with the other ranks.

``DcpLeader`` holds rank 0's shard, the other ranks (``DcpRanks``) and the engine ids the prefill
node binds a grant to. ``pull`` lands every rank's share of a grant at once: rank 0 pulls its own
into the allocation its scheduler made (keeping its share of the grant until all landed) while the
others Land theirs; if any rank fails, or the caller is cancelled, the other ranks' blocks (Drop)
and the whole grant on the prefill node (rank 0 releases all ranks' shares) are given back, and
rank 0's allocation stays its scheduler's to release.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from kpool_pd.connector import LandedRequest, PrefillGrant, PrefillPeer, StatusError, Transport, status_of
from kpool_pd.decode_worker.dcp_ranks import DcpRanks
from kpool_pd.kvcache import CacheAllocation, DcpConfig, DcpShard

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class RankTransfer:
    """What one request's transfer cost over every rank: bytes and regions summed, the slowest rank's time."""

    nbytes: int
    regions: int
    ms: float
    per_rank_bytes: tuple[int, ...]


class DcpLeader:
    """Rank 0's view of its instance (one event loop)."""

    def __init__(self, dcp: DcpConfig, ranks: DcpRanks, engine_id: str) -> None:
        self.dcp, self.ranks = dcp, ranks
        self.shard: DcpShard = dcp.shard(0)
        self.engine_ids = (engine_id, *(f"{engine_id}/dcp{rank}" for rank in range(1, dcp.size)))

    async def pull(self, request_id: str, max_tokens: int, allocation: CacheAllocation, peer: PrefillPeer,
                   grant: PrefillGrant, transport: Transport | None, integrity: bool) -> tuple[LandedRequest, RankTransfer]:
        """Every rank's share landed (rank 0's into ``allocation``, as the returned LandedRequest), and
        every share of the grant released. StatusError (after giving the other ranks' blocks and the
        grant back) when a rank's pull failed."""
        own = asyncio.ensure_future(peer.pull(grant, into=allocation, transport=transport,
                                              integrity=integrity, release=False, dcp=self.shard))
        others = asyncio.ensure_future(self.ranks.land(request_id, max_tokens, peer.address, grant, transport,
                                                       integrity))
        try:
            done = await asyncio.gather(own, others, return_exceptions=True)
        except asyncio.CancelledError:
            await asyncio.gather(own, others, return_exceptions=True)
            self._give_back(request_id, peer, grant)
            raise
        failures = [r for r in done if isinstance(r, BaseException)]
        if failures:
            self._give_back(request_id, peer, grant)
            raise status_of(failures[0], "DCP pull")
        landed, responses = done
        await peer.release_within(grant.grant_id, peer.context.config.rpc_timeout_s, dcp_rank=0)
        per_rank = (landed.nbytes, *(r.transfer_bytes for r in responses))
        transfer = RankTransfer(nbytes=sum(per_rank), regions=landed.regions + sum(r.transfer_regions for r in responses),
                                ms=max([landed.seconds * 1000, *(r.transfer_ms for r in responses)]),
                                per_rank_bytes=per_rank)
        return landed, transfer

    def _give_back(self, request_id: str, peer: PrefillPeer, grant: PrefillGrant) -> None:
        self.ranks.drop_soon(request_id)
        peer.release_soon(grant.grant_id, all_ranks=True)
        logger.info("request %s: a DCP rank's pull failed; the other ranks' blocks and the grant given back", request_id)

    async def step(self, own: Awaitable[T], request_ids: Sequence[str]) -> T:
        """Rank 0's step of the batch (``own``) while every other rank steps it; ``own``'s result."""
        return await self._together(own, self.ranks.step(request_ids))

    async def _together(self, own: Awaitable[T], others: Awaitable[None]) -> T:
        """Rank 0's part of a collective and the other ranks', both to their end; the first failure
        raised as a StatusError (a failed rank breaks the instance: ``DcpRanks.fail``).

        An instance that breaks meanwhile (a rank's process exited: the watcher's ``fail``) ends the wait
        at once with UNAVAILABLE: the surviving ranks' collectives, rank 0's own among them, may wait for
        the dead rank until the group's timeout. The other ranks' calls are cancelled; rank 0's part, a
        thread inside the collective, is left to end by itself (the broken instance stops its process)."""
        mine_task, theirs_task = asyncio.ensure_future(own), asyncio.ensure_future(others)
        both = asyncio.gather(mine_task, theirs_task, return_exceptions=True)
        broken = asyncio.ensure_future(self.ranks.until_broken())
        try:
            await asyncio.wait({both, broken}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            both.cancel()  # as a cancelled gather does: both parts are cancelled
            raise
        finally:
            broken.cancel()
        if not both.done():  # ``both`` then ends with the two cancellations as its result
            theirs_task.cancel()
            mine_task.cancel()  # the thread goes on; its result is dropped
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"the DCP decode instance is broken: {self.ranks.broken}")
        mine, theirs = both.result()
        for failure in (mine, theirs):
            if isinstance(failure, StatusError):
                raise failure
            if isinstance(failure, BaseException):
                self.ranks.fail(f"rank 0 failed in a collective: {type(failure).__name__}: {failure}")
                raise StatusError(grpc.StatusCode.UNAVAILABLE, f"DCP rank 0: {failure}")
        return mine

    def drop(self, request_id: str) -> None:
        self.ranks.drop_soon(request_id)
