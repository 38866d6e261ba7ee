"""Pulls as the connector tests make them: the decode side's allocation made by the test (the
connector never allocates), the pull into it, and both kept together until the test releases them."""

from __future__ import annotations

from kpool_pd.connector import WHOLE_REQUEST, LandedRequest, PrefillGrant, PrefillPeer, RankShare
from kpool_pd.kvcache import CacheAllocation, DcpShard, NodeCache


class Pulled:
    """A pull's ``LandedRequest`` (its attributes read through) and the allocation it landed in,
    which this object holds until ``release()`` (idempotent; also on leaving a ``with``)."""

    def __init__(self, landed: LandedRequest, allocation: CacheAllocation) -> None:
        self.landed, self.allocation = landed, allocation

    def __getattr__(self, name: str):
        if name in ("landed", "allocation") or name.startswith("__"):  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self.landed, name)

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self.allocation.block_ids

    @property
    def ring_id(self) -> int:
        return self.allocation.ring_id

    @property
    def released(self) -> bool:
        return self.allocation.released

    def release(self) -> None:
        self.allocation.release()

    def __enter__(self) -> "Pulled":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def allocation_for(cache: NodeCache, grant: PrefillGrant, *, reserve_blocks: int = 0,
                   dcp: DcpShard | None = None) -> CacheAllocation:
    """The prompt's blocks (at least ``reserve_blocks``) and a ring in ``cache``, as a decode node's
    scheduler takes them before it pulls ``grant``; the caller releases them."""
    prompt = (dcp.blocks_for_tokens(cache.config, grant.prompt_len) if dcp is not None
              else cache.config.blocks_for_tokens(grant.prompt_len))  # the prompt's blocks (a rank's share)
    return cache.allocate(grant.request_id, max(prompt, reserve_blocks))


async def pull_into(cache: NodeCache, peer: PrefillPeer, grant: PrefillGrant, *, reserve_blocks: int = 0,
                    dcp: DcpShard | None = None, **pull_options) -> Pulled:
    """Allocate the prompt's blocks (at least ``reserve_blocks``) and a ring in ``cache``, pull ``grant``
    into them, and return both; a failed or cancelled pull releases the allocation before it raises."""
    allocation = allocation_for(cache, grant, reserve_blocks=reserve_blocks, dcp=dcp)
    try:
        landed = await peer.pull(grant, into=allocation, share=RankShare(dcp) if dcp is not None else WHOLE_REQUEST,
                                 **pull_options)
    except BaseException:
        allocation.release()
        raise
    return Pulled(landed, allocation)
