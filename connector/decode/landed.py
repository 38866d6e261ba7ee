"""What a decode node holds for one request: the grant a Prefill call returned, the blocks and ring
it took in its own pool, and the request once a pull landed it there."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from connector.shared.errors import StatusError
from connector.shared.plan import RingRange
from connector.shared.wire import Transport
from kvcache import BlockAllocator, RingAllocator

if TYPE_CHECKING:
    from connector.decode.inbound import PullTimeline

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PrefillGrant:
    """What a Prefill call returned: the grant to pull, what the decode node allocates, and the
    source side of the transfer plan (the prefill node's blocks and ring), so that the decode node
    plans and posts its receives before it pulls."""

    grant_id: str
    request_id: str
    prompt_len: int
    num_blocks: int
    ring_live: RingRange
    first_token: int
    lease_s: float
    src_block_ids: tuple[int, ...]
    src_ring_id: int
    pipelined: bool = False  # the prompt was still computing: ``first_token`` (0 here) comes with the pull
    piece_blocks: int = 0  # the transfer plan's piece size (``connector.shared.plan.plan_transfer``)
    prefill_ms: float = 0.0  # the prompt's compute (not pipelined; a pipelined pull reports it)


@dataclass(frozen=True, kw_only=True)
class TransferTimes:
    """Where a request's time to first token went on its way to the decode node, in milliseconds:
    ``prefill_ms`` the prompt on the prefill node (Prefill call to its last chunk computed),
    ``transfer_ms`` moving all of its bytes (not pipelined: Pull to the last byte landed; pipelined: the
    time its regions were being sent, overlapping sends counted once), ``exposed_transfer_ms`` from the end
    of the last chunk's compute to every byte landed here (not pipelined: the whole transfer; pipelined: the
    larger of the decode node's time from the prefill node's PrefillDone, sent as that compute ended, to
    the last byte landed, and the prefill node's time from that end to its last send completed: each
    clock measures its own side, and neither counts the last message's one-way latency)."""

    prefill_ms: float
    transfer_ms: float
    exposed_transfer_ms: float


class Allocation:
    """A request's blocks and ring in the decode node's pool (the ring is keyed by the request id).

    ``take`` allocates both or nothing; ``free()`` returns both (idempotent). One object frees
    them, whichever path the request leaves by."""

    __slots__ = ("request_id", "block_ids", "ring_id", "_blocks", "_rings", "_freed")

    def __init__(self, request_id: str, block_ids: tuple[int, ...], ring_id: int, blocks: BlockAllocator,
                 rings: RingAllocator) -> None:
        self.request_id, self.block_ids, self.ring_id = request_id, block_ids, ring_id
        self._blocks, self._rings = blocks, rings
        self._freed = False

    @classmethod
    def take(cls, blocks: BlockAllocator, rings: RingAllocator, request_id: str, num_blocks: int) -> "Allocation":
        """``num_blocks`` blocks and a ring, or StatusError with nothing taken: RESOURCE_EXHAUSTED
        when the pool is short, ALREADY_EXISTS when the request already holds a ring."""
        if num_blocks > blocks.num_free or rings.num_free == 0:
            raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"request {request_id} needs {num_blocks} blocks and a ring; free: "
                              f"{blocks.num_free} blocks, {rings.num_free} rings")
        try:
            ring_id = rings.allocate(request_id)
        except ValueError as exc:
            raise StatusError(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
        return cls(request_id, tuple(blocks.allocate(num_blocks)), ring_id, blocks, rings)

    @property
    def freed(self) -> bool:
        return self._freed

    def free(self) -> None:
        if not self._freed:
            self._freed = True
            self._blocks.free(list(self.block_ids))
            self._rings.free(self.request_id)


class LandedRequest:
    """A request's blocks and ring in the decode node's pool, filled by a pull.

    ``block_ids`` are every block the pull reserved: the prompt's blocks first (landed, in
    block-table order; as many as the prompt needs in this node's block size, which may differ
    from the prefill node's ``grant.num_blocks``), then the blocks reserved for the tokens still
    to come.
    Owns them all until ``release()`` (idempotent) frees them; a context manager. ``__del__``
    only reports a leak."""

    __slots__ = ("grant", "transport", "nbytes", "regions", "seconds", "repacked", "timeline", "first_token", "times",
                 "prompt_blocks", "_allocation")

    def __init__(self, grant: PrefillGrant, allocation: Allocation, *, transport: Transport, nbytes: int, regions: int,
                 seconds: float, repacked: bool = False, timeline: "PullTimeline | None" = None,
                 first_token: int | None = None, times: TransferTimes | None = None,
                 prompt_blocks: int | None = None) -> None:
        self.grant = grant
        self.prompt_blocks = grant.num_blocks if prompt_blocks is None else prompt_blocks  # landed, in our block size
        self.first_token = grant.first_token if first_token is None else first_token  # the prompt's next token
        self.times = times or TransferTimes(prefill_ms=grant.prefill_ms, transfer_ms=seconds * 1000,
                                            exposed_transfer_ms=seconds * 1000)
        self.transport, self.nbytes, self.regions, self.seconds = transport, nbytes, regions, seconds
        self.repacked = repacked  # landed in a staging buffer and converted from the peer's block order
        self.timeline = timeline  # where the pull's time went (connector.decode.inbound.PullTimeline)
        self._allocation = allocation

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self._allocation.block_ids

    @property
    def ring_id(self) -> int:
        return self._allocation.ring_id

    @property
    def released(self) -> bool:
        return self._allocation.freed

    def release(self) -> None:
        self._allocation.free()

    def __enter__(self) -> "LandedRequest":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        allocation = getattr(self, "_allocation", None)
        if allocation is not None and not allocation.freed:
            logger.error("LandedRequest %s was never released: %d blocks leak", self.grant.request_id,
                         len(allocation.block_ids))

    def __repr__(self) -> str:
        return (f"LandedRequest({self.grant.request_id!r}, blocks={len(self.block_ids)} "
                f"({self.prompt_blocks} landed), ring={self.ring_id}, "
                f"{self.nbytes} B in {self.regions} regions over {self.transport.label}, "
                f"{'released' if self.released else 'held'})")
