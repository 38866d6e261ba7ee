"""Where a pull from a prefill node of another arrangement (block size, order, kernel page) lands before the
repack places it in our blocks, and how the blocks' next reader knows the repack is done.

``RepackStaging`` keeps a peer's staging buffers from one pull to the next, so that such a pull lands as a
same-layout pull does: straight into memory that is already there (UCX has seen it before), with no allocation
on its way and the repack's staged block table (0..n-1) already on the device. A buffer goes back once its pull
ended; it is handed out again only once the repack that reads it has run (``BlocksReady.done``), since UCX
writes into it outside any CUDA stream's order.

``BlocksReady`` is what a pull returns about its blocks: on CUDA the event recorded on the pool device's current
stream right behind the repack (the decode steps run on that stream and need nothing more; a reader on another
stream calls ``wait``, which makes that stream wait on the device, never the host); on the CPU the repack ran in
the call and the blocks are ready at once.
"""

from __future__ import annotations

import logging

import torch

from kpool_pd.kvcache import BlockLayout

logger = logging.getLogger(__name__)

# Idle buffers a peer keeps for its next pulls; more are freed once their repack has run. One: a buffer holds a
# whole request in the peer's layout (1.3 GB for 32k tokens of 61 layers), so a node keeps one a peer.
KEEP_IDLE = 1


class BlocksReady:
    """Whether the blocks a pull landed (the repack's writes into them) are complete; ``NOW`` when they were
    complete as the pull returned. Reusable, no resources to release."""

    __slots__ = ("event", "device")
    NOW: "BlocksReady"

    def __init__(self, event: torch.cuda.Event | None = None, device: torch.device | None = None) -> None:
        self.event, self.device = event, device  # the CUDA event and the device of the stream it was recorded on

    @classmethod
    def behind_current_work(cls, device: torch.device) -> "BlocksReady":
        """Ready once the work enqueued so far on ``device``'s current stream has run (CPU: ``NOW``)."""
        if device.type != "cuda":
            return cls.NOW
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return cls(event, device)

    @property
    def done(self) -> bool:
        """True once the blocks are complete (asks the device; never waits)."""
        return self.event is None or self.event.query()

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream of the event's device) wait for the blocks on the device;
        the host goes on at once. Work on the stream the repack ran on is ordered behind it already."""
        if self.event is not None:
            self.event.wait(stream if stream is not None else torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        """Block the host until the blocks are complete (for a reader outside any stream, e.g. a host copy)."""
        if self.event is not None:
            self.event.synchronize()

    def __repr__(self) -> str:
        return f"BlocksReady({'done' if self.done else 'pending on the device'})"


BlocksReady.NOW = BlocksReady()


class StagedBuffer:
    """One staging buffer lent to a pull: ``blocks`` uint8 [n, peer block_bytes] (the first n rows of a kept
    buffer) and ``ids`` int64 [n] = 0..n-1 on the buffer's device (the repack's staged block table)."""

    __slots__ = ("blocks", "ids", "_whole")

    def __init__(self, whole: torch.Tensor, ids: torch.Tensor, num_blocks: int) -> None:
        self._whole, self.blocks, self.ids = whole, whole[:num_blocks], ids[:num_blocks]


class RepackStaging:
    """The staging buffers of the pulls from one peer layout into a pool on ``device``. ``take`` lends one of
    at least n blocks (a kept one whose repack has run, else a new one of n blocks rounded up to a power of
    two); ``give_back`` returns it with the readiness of the repack that reads it. Used from the connector's
    event loop only; a pull that failed with receives still pending (a dead sender's) does not give its buffer
    back. At most ``keep_idle`` idle buffers are kept."""

    def __init__(self, peer_layout: BlockLayout, device: torch.device | str, *, keep_idle: int = KEEP_IDLE) -> None:
        if keep_idle < 0:
            raise ValueError(f"keep_idle must be >= 0, got {keep_idle}")
        self.peer_layout, self.device, self.keep_idle = peer_layout, torch.device(device), keep_idle
        self._idle: list[tuple[torch.Tensor, BlocksReady]] = []  # (buffer [m, block_bytes], its last repack)
        self._ids = torch.arange(0, device=self.device)  # 0..k-1, grown as needed
        self.made = 0  # buffers allocated so far (a pull that found none to reuse)

    def take(self, num_blocks: int) -> StagedBuffer:
        """A buffer of at least ``num_blocks`` blocks that no repack reads any more (ValueError for fewer than 1)."""
        if num_blocks < 1:
            raise ValueError(f"a staging buffer holds at least 1 block, got {num_blocks}")
        fits = [i for i, (buffer, ready) in enumerate(self._idle) if buffer.shape[0] >= num_blocks and ready.done]
        if fits:
            whole, _ = self._idle.pop(min(fits, key=lambda i: self._idle[i][0].shape[0]))
        else:
            rows = 1 << (num_blocks - 1).bit_length()
            whole = torch.empty(rows, self.peer_layout.block_bytes, dtype=torch.uint8, device=self.device)
            self.made += 1
        if self._ids.numel() < whole.shape[0]:
            self._ids = torch.arange(whole.shape[0], device=self.device)
        return StagedBuffer(whole, self._ids, num_blocks)

    def give_back(self, staged: StagedBuffer, ready: BlocksReady) -> None:
        """``staged`` is free once ``ready`` is done (a failed pull's: ``BlocksReady.NOW``, nothing reads it).
        Buffers over ``keep_idle`` are dropped, the smallest first, once nothing reads them."""
        self._idle.append((staged._whole, ready))
        while len(self._idle) > self.keep_idle:
            done = [i for i, (_, r) in enumerate(self._idle) if r.done]
            if not done:
                break  # dropped at a later give_back, once their repacks have run
            self._idle.pop(min(done, key=lambda i: self._idle[i][0].shape[0]))

    @property
    def idle(self) -> int:
        """Buffers kept for the next pulls."""
        return len(self._idle)

    def __repr__(self) -> str:
        return (f"RepackStaging({self.idle} idle, {self.made} made, on {self.device}, "
                f"{self.peer_layout.block_bytes} B a block)")
