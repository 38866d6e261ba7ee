"""What a decode node learns of one request: the grant a Prefill call returned, and how the pull that
landed it in the caller's allocation went."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from connector.shared.plan import RingRange
from connector.shared.wire import Transport

if TYPE_CHECKING:
    from connector.decode.inbound import PullTimeline


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


@dataclass(frozen=True, kw_only=True)
class LandedRequest:
    """How a pull landed a request in the caller's allocation: the prompt's ``prompt_blocks`` blocks
    (in this node's block size, which may differ from the prefill node's ``grant.num_blocks``) are
    the allocation's first, the ring is its ring. The allocation stays the caller's (it released
    nothing and holds nothing): ``nbytes`` in ``regions`` regions over ``transport`` in
    ``seconds``, ``repacked`` when they landed in staging and were converted from the peer's
    arrangement, ``timeline`` where the pull's time went (``connector.pull.PullTimeline``), and the
    prompt's next token."""

    grant: PrefillGrant
    transport: Transport
    nbytes: int
    regions: int
    seconds: float
    prompt_blocks: int
    first_token: int
    times: TransferTimes
    repacked: bool = False
    timeline: "PullTimeline | None" = None

    def __repr__(self) -> str:
        return (f"LandedRequest({self.grant.request_id!r}, {self.prompt_blocks} blocks landed, "
                f"{self.nbytes} B in {self.regions} regions over {self.transport.label})")
