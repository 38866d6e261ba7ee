"""How a decode node fetches a request's cache and steps its batch: a strategy the daemon picks once at
start, which the scheduler asks and never tells apart.

* ``OneNode``: this process holds the whole request; it pulls the prompt into the request's allocation
  and steps alone.
* ``DcpRanks`` (``kpool_pd.decode_worker.dcp_fetch``): rank 0 of a DCP decode instance; every rank pulls
  and holds its own share, and every step and digest is a collective of all ranks.

Each one counts a request's blocks with its own config (``blocks_for_request``), asks a prefill node for
the grant (``prefill``), lands it and releases it (``pull``), and steps a batch (``step``). A failed pull
has given back what it could before it raises; the request's own allocation stays the scheduler's.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from kpool_pd.connector import PrefillGrant, PrefillPeer, StatusError, Transport
from kpool_pd.decode_worker.jobs import Job, JobState
from kpool_pd.kvcache import CacheConfig

T = TypeVar("T")

# A pull failed so that this engine cannot pull from the node now (gone, timed out, or its engine id refused):
# the router skips the node and handshakes again (presenting the engine's secret) at its next check.
CANNOT_PULL = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.PERMISSION_DENIED)


@dataclass(frozen=True, kw_only=True)
class RankTransfer:
    """What one request's transfer cost over every rank: bytes and regions summed, the slowest rank's time,
    and each rank's bytes (one rank: the request's)."""

    nbytes: int
    regions: int
    ms: float
    per_rank_bytes: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class PullChoice:
    """How pulls go: ``transport`` (None: UCX when both sides have it), ``integrity`` (a crc32 per region),
    ``rpc_timeout_s`` (how long a landed pull waits for its Release's answer)."""

    transport: Transport | None
    integrity: bool
    rpc_timeout_s: float


class RequestFetch(abc.ABC):
    """The strategy; see the module docstring. ``digests_in_step``: a finished request's state digest is
    taken inside the step (a collective, in the decode loop's order), not beside it."""

    digests_in_step: bool = False

    def __init__(self, cache: CacheConfig, pulls: PullChoice) -> None:
        self.cache, self.pulls = cache, pulls

    def check_usable(self) -> None:
        """StatusError UNAVAILABLE when no request can be fetched any more (a broken instance)."""

    @abc.abstractmethod
    def blocks_for_request(self, prompt_len: int, max_tokens: int) -> int:
        """Blocks this node allocates for a request (its prompt and output; a rank's share)."""

    @abc.abstractmethod
    async def prefill(self, peer: PrefillPeer, job: Job) -> PrefillGrant:
        """The grant for ``job``'s prompt from ``peer`` (StatusError as ``PrefillPeer.prefill`` raises)."""

    @abc.abstractmethod
    async def pull(self, job: Job, peer: PrefillPeer, grant: PrefillGrant) -> RankTransfer:
        """Land ``grant`` (``job.landed`` set) into ``job.allocation`` (and the other ranks'), and release it.
        StatusError after giving back the grant where the node can take it; ``job.state`` RELEASING while the
        Release runs. Cancelling it leaves the prefill node no grant to expire."""

    def pushes_to(self, peer: PrefillPeer) -> bool:
        """Whether ``prefill`` lands the prompt too (a push), so that its failure may be a pull's."""
        return False

    @abc.abstractmethod
    def skips_node(self, failure: StatusError) -> bool:
        """Whether a pull that failed so says that the prefill node cannot be pulled from now."""

    async def step(self, own: Awaitable[T], request_ids: Sequence[str]) -> T:
        """This node's step of the batch (``own``) and, with ranks, theirs; ``own``'s result."""
        return await own

    def drop(self, request_id: str) -> None:
        """A landed request ends here: whatever else holds it frees it."""


class OneNode(RequestFetch):
    """One process holds the whole request (no DCP)."""

    def __init__(self, cache: CacheConfig, pulls: PullChoice, *, pipelined: bool, push: bool = True) -> None:
        super().__init__(cache, pulls)
        self.pipelined = pipelined  # ask prefill nodes to answer before the prompt is computed (PrefillPeer.prefill)
        self.push = push  # pipelined, with a node that takes it: the prompt and its pull in one call (PrefillPeer.push)

    def pushes_to(self, peer: PrefillPeer) -> bool:
        return self.pipelined and self.push and peer.pushes

    def blocks_for_request(self, prompt_len: int, max_tokens: int) -> int:
        return self.cache.blocks_for_request(prompt_len, max_tokens)

    async def prefill(self, peer: PrefillPeer, job: Job) -> PrefillGrant:
        """Pipelined, from a node that takes pushes: the prompt and its pull in one call (``PrefillPeer.push``),
        so the bytes land as the prompt completes, with no message after it; the grant returned has landed
        (``job.landed``), and ``pull`` only releases it. Otherwise the grant, which ``pull`` lands."""
        if self.pushes_to(peer):
            job.landed = await peer.push(job.request_id, job.prompt, into=job.allocation,
                                         transport=self.pulls.transport, integrity=self.pulls.integrity,
                                         mrope_positions=job.mrope_positions, on_granted=lambda _: job.pulling())
            return job.landed.grant
        return await peer.prefill(job.request_id, job.prompt, pipelined=self.pipelined,
                                  mrope_positions=job.mrope_positions)

    async def pull(self, job: Job, peer: PrefillPeer, grant: PrefillGrant) -> RankTransfer:
        wait_s = self.pulls.rpc_timeout_s
        try:
            if job.landed is None or job.landed.grant is not grant:  # not pushed: pull it now
                job.landed = await peer.pull(grant, into=job.allocation, transport=self.pulls.transport,
                                             integrity=self.pulls.integrity, release=False)
        except asyncio.CancelledError:
            peer.release_soon(grant.grant_id)  # the client left: the prefill node frees its blocks now
            raise
        except StatusError as exc:
            if exc.code is not grpc.StatusCode.UNAVAILABLE:  # the node is up: free its blocks now, not at lease end
                await peer.release_within(grant.grant_id, wait_s)
            raise
        job.state = JobState.RELEASING
        await peer.release_within(grant.grant_id, wait_s)  # tried again in the background past wait_s
        landed = job.landed
        return RankTransfer(nbytes=landed.nbytes, regions=landed.regions, ms=landed.times.transfer_ms,
                            per_rank_bytes=(landed.nbytes,))

    def skips_node(self, failure: StatusError) -> bool:
        return failure.code in CANNOT_PULL
