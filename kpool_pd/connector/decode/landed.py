"""How the pull that landed a request in the caller's allocation went (the grant it pulled and the
timings are ``kpool_pd.connector.decode.grant``'s records)."""

from __future__ import annotations

from dataclasses import dataclass

from kpool_pd.connector.decode.grant import PrefillGrant, PullTimeline, TransferTimes
from kpool_pd.connector.decode.staging import BlocksReady
from kpool_pd.connector.shared.wire import Transport


@dataclass(frozen=True, kw_only=True)
class LandedRequest:
    """How a pull landed a request in the caller's allocation: the prompt's ``prompt_blocks`` blocks
    (in this node's block size, which may differ from the prefill node's ``grant.num_blocks``) are
    the allocation's first, the ring is its ring. The allocation stays the caller's (it released
    nothing and holds nothing): ``nbytes`` in ``regions`` regions over ``transport`` in
    ``seconds``, ``repacked`` when they landed in staging and were converted from the peer's
    arrangement, ``timeline`` where the pull's time went (``PullTimeline``), and the
    prompt's next token. ``held_blocks``: the prompt's blocks the allocation held already (a prefix
    hit), which were not pulled. ``ready``: when the blocks' bytes are complete: at once, or for a repacked
    pull on CUDA once the repack enqueued on the pool device's current stream has run (work on that stream is
    ordered behind it; a reader on another stream calls ``ready.wait()``, a host reader ``ready.synchronize()``)."""

    grant: PrefillGrant
    transport: Transport
    nbytes: int
    regions: int
    seconds: float
    prompt_blocks: int
    first_token: int
    times: TransferTimes
    repacked: bool = False
    timeline: PullTimeline | None = None
    held_blocks: int = 0
    ready: BlocksReady = BlocksReady.NOW

    def __repr__(self) -> str:
        return (f"LandedRequest({self.grant.request_id!r}, {self.prompt_blocks} blocks landed, "
                f"{self.nbytes} B in {self.regions} regions over {self.transport.label})")
