"""The records a decode node keeps of one request on its way from a prefill node: the grant a Prefill call
returned (``PrefillGrant``), where the time to first token went (``TransferTimes``) and where one pull's
time went (``PullTimeline``). Plain frozen records: the peer, the pull and the landed request read them."""

from __future__ import annotations

from dataclasses import dataclass

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.shared.plan import RingRange
from kpool_pd.connector.shared.wire import ring_from


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
    piece_blocks: int = 0  # the transfer plan's piece size (``kpool_pd.connector.shared.plan.plan_transfer``)
    prefill_ms: float = 0.0  # the prompt's compute (not pipelined; a pipelined pull reports it)


def grant_from(r: pb.PrefillResponse) -> PrefillGrant:
    """The grant a Prefill response (or a push's ``granted`` message) states."""
    return PrefillGrant(grant_id=r.grant_id, request_id=r.request_id, prompt_len=r.prompt_len, num_blocks=r.num_blocks,
                        ring_live=ring_from(r.ring_live), first_token=r.first_token, lease_s=r.lease_ms / 1000,
                        src_block_ids=tuple(r.src_block_ids), src_ring_id=r.src_ring_id, pipelined=r.pipelined,
                        piece_blocks=r.piece_blocks, prefill_ms=r.prefill_ms)


@dataclass(frozen=True, kw_only=True)
class TransferTimes:
    """Where a request's time to first token went on its way to the decode node, in milliseconds:
    ``prefill_ms`` the prompt on the prefill node (Prefill call to its last chunk computed),
    ``transfer_ms`` moving all of its bytes (not pipelined: Pull to the last byte landed; pipelined: the
    time its regions were being sent, overlapping sends counted once: PullDone's, or where the pull ended
    before it, PrefillDone's so far and the bytes that landed here after it came), ``exposed_transfer_ms``
    from the prompt's last chunk written to every byte landed here (not pipelined: the whole transfer;
    pipelined: the prefill node's time from the prompt's end to PrefillDone's sending, or to its last send's
    end where all had completed, which PrefillDone states, plus the decode node's time from PrefillDone's
    arrival to the last byte landed: PrefillDone's one-way latency is not counted). From a prefill node whose
    PrefillDone states no times: the larger of the decode node's part and the prefill node's time from the
    prompt's end to its last send completed, where PullDone came before the pull ended."""

    prefill_ms: float
    transfer_ms: float
    exposed_transfer_ms: float


@dataclass(frozen=True)
class PullTimeline:
    """Where one pull's time went, in milliseconds, from planning to the bytes in place: ``post``
    planning and posting the receives, ``wire`` from the Pull call until the sender's PullDone (the gRPC
    stream: landing its chunks too; the plan travels in the request, so no control message is waited on
    first), ``completion`` until every UCX receive completed after that, ``verify`` the integrity check and
    the conversion from the peer's block order. A UCX pull without integrity waits on its receives alone:
    ``completion`` is 0, ``wire`` runs from the Pull call to the last receive landed."""

    post_ms: float
    wire_ms: float
    completion_ms: float
    verify_ms: float

    @property
    def total_ms(self) -> float:
        return self.post_ms + self.wire_ms + self.completion_ms + self.verify_ms
