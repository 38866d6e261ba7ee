"""How rank 0 of a DCP decode instance fetches a request and steps its batch with the other ranks.

``DcpLeader`` is the DCP ranks' ``RequestFetch`` (``kpool_pd.decode_worker.fetch``): it holds rank 0's
share, the other ranks (``DcpRanks``) and the engine ids the prefill node binds a grant to. ``pull`` lands every rank's share of a grant at once: rank 0 pulls its own
into the allocation its scheduler made (keeping its share of the grant until all landed) while the
others Land theirs; if any rank fails, or the caller is cancelled, the other ranks' blocks (Drop)
and the whole grant on the prefill node (rank 0 releases all ranks' shares) are given back, and
rank 0's allocation stays its scheduler's to release.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import TypeVar

import grpc

from kpool_pd.connector import PrefillGrant, PrefillPeer, RankShare, StatusError, status_of
from kpool_pd.decode_worker.dcp_ranks import DcpRanks
from kpool_pd.decode_worker.fetch import PullChoice, RankTransfer, RequestFetch
from kpool_pd.decode_worker.jobs import Job
from kpool_pd.kvcache import CacheConfig, DcpConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")


class DcpLeader(RequestFetch):
    """Rank 0's view of its instance (one event loop): the fetch of a DCP decode instance's ranks."""

    digests_in_step = True  # a digest is a collective: the ranks take it in the decode loop's order

    def __init__(self, cache: CacheConfig, pulls: PullChoice, dcp: DcpConfig, ranks: DcpRanks, engine_id: str) -> None:
        super().__init__(cache, pulls)
        self.dcp, self.ranks = dcp, ranks
        self.share = RankShare(dcp.shard(0))  # what rank 0's own pulls land
        self.engine_ids = (engine_id, *(f"{engine_id}/dcp{rank}" for rank in range(1, dcp.size)))

    def check_usable(self) -> None:
        if self.ranks.broken:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"the DCP decode instance is broken: {self.ranks.broken}")

    def blocks_for_request(self, prompt_len: int, max_tokens: int) -> int:
        return self.dcp.rank_blocks_for_request(self.cache, prompt_len, max_tokens)

    async def prefill(self, peer: PrefillPeer, job: Job) -> PrefillGrant:
        """A grant every rank pulls its share of; a failure while the instance broke is the instance's."""
        try:
            return await peer.prefill(job.request_id, job.prompt, dcp_engine_ids=self.engine_ids,
                                      dcp_interleave=self.dcp.interleave)
        except StatusError:
            self.check_usable()
            raise

    async def pull(self, job: Job, peer: PrefillPeer, grant: PrefillGrant) -> RankTransfer:
        """Every rank's share landed (rank 0's into ``job.allocation``, as ``job.landed``), and every share of
        the grant released. StatusError (after giving the other ranks' blocks and the grant back) when a
        rank's pull failed."""
        own = asyncio.ensure_future(peer.pull(grant, into=job.allocation, transport=self.pulls.transport,
                                              integrity=self.pulls.integrity, release=False, share=self.share))
        others = asyncio.ensure_future(self.ranks.land(job.request_id, job.max_tokens, peer.address, grant,
                                                       self.pulls.transport, self.pulls.integrity))
        try:
            done = await asyncio.gather(own, others, return_exceptions=True)
        except asyncio.CancelledError:
            await asyncio.gather(own, others, return_exceptions=True)
            self._give_back(job.request_id, peer, grant)
            raise
        failures = [r for r in done if isinstance(r, BaseException)]
        if failures:
            self._give_back(job.request_id, peer, grant)
            raise status_of(failures[0], "DCP pull")
        landed, responses = done
        job.landed = landed
        await peer.release_within(grant.grant_id, self.pulls.rpc_timeout_s, dcp_rank=self.share.rank)
        per_rank = (landed.nbytes, *(r.transfer_bytes for r in responses))
        return RankTransfer(nbytes=sum(per_rank), regions=landed.regions + sum(r.transfer_regions for r in responses),
                            ms=max([landed.seconds * 1000, *(r.transfer_ms for r in responses)]),
                            per_rank_bytes=per_rank)

    def skips_node(self, failure: StatusError) -> bool:
        return failure.code is grpc.StatusCode.UNAVAILABLE and not self.ranks.broken

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
