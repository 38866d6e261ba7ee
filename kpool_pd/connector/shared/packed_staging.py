"""Staging buffers kept between PackedPull batches (``kpool_pd.connector.prefill.packed_pulls``,
``kpool_pd.connector.decode.packed_pull``): a batch's bytes pass through one buffer on each node, and a buffer
allocated afresh costs its first touch (page faults: on the CPU machine, packing 10 MiB into a new buffer took
about five times as long as into one used before). A node keeps a few, and a batch takes one at least as large
as it needs (a larger one made, and touched once, when none is)."""

from __future__ import annotations

import torch

KEPT = 4  # buffers a node keeps between batches (several batches may run at once: one per decode engine)
PIECE_BYTES = 1 << 20  # a batch's message goes in pieces of this many bytes: under UCX's eager limit for host memory


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i (uint8 views of equal sizes, one device). In host memory each is a
    plain copy of numpy views, under the interpreter's lock: torch's copy releases the lock for each region
    (the connector's thread then waits for it again behind the engine's thread, up to a switch interval each)
    and runs on the engine's OpenMP pool, which a loaded 2-core machine made take hundreds of ms for a batch.
    On a GPU, one ``torch._foreach_copy_``."""
    if not dst:
        return
    if dst[0].device.type == "cpu":
        for d, s in zip(dst, src):
            d.numpy()[:] = s.numpy()
    else:
        torch._foreach_copy_(dst, src)


def pieces(total: int, piece_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each piece of a ``total``-byte message cut every ``piece_bytes``."""
    return [(at, min(piece_bytes, total - at)) for at in range(0, total, piece_bytes)]


def piece_parts(spans: list[tuple[int, int]], total: int, piece_bytes: int):
    """For each ``piece_bytes`` piece of a ``total``-byte message, in order: ((offset, length), the parts of
    ``spans`` it holds as (span index, first byte, end) in message offsets). ``spans``: (offset, nbytes), increasing
    offsets, not overlapping, within the message (bytes no span covers belong to no part)."""
    next_span = 0
    for begin, length in pieces(total, piece_bytes):
        end, parts = begin + length, []
        while next_span < len(spans) and spans[next_span][0] < end:
            at, nbytes = spans[next_span]
            parts.append((next_span, max(at, begin), min(at + nbytes, end)))
            if at + nbytes > end:
                break  # the span goes on in the next piece
            next_span += 1
        yield (begin, length), parts


def piece_views(spans: list[tuple[int, torch.Tensor]], message: torch.Tensor, piece_bytes: int):
    """``piece_parts`` as views: for each ``piece_bytes`` piece of ``message``, in order: ((offset, length), the
    views of ``spans``' tensors it holds, the views of ``message`` they sit at), the two lists pairwise alike, for
    the pack (spans into the message) and the landing (the message into spans) to copy piece by piece.
    # spans: [(offset, uint8 [n])], increasing offsets, not overlapping, within message: uint8 [total]"""
    for piece, parts in piece_parts([(at, view.numel()) for at, view in spans], message.numel(), piece_bytes):
        yield (piece, [spans[index][1][lo - spans[index][0]:hi - spans[index][0]] for index, lo, hi in parts],
               [message[lo:hi] for _, lo, hi in parts])


class StagingBuffers:
    """uint8 buffers on ``device``, lent to one batch at a time (``take``, ``give``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """uint8 [>= nbytes], the batch's until ``give``: the smallest kept buffer that fits, else a new one
        (rounded up to a power of two, touched now)."""
        fitting = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
        if fitting:  # by index: a tensor's == compares its elements
            return self._free.pop(min(fitting, key=lambda i: self._free[i].numel()))
        size = 1 << max(nbytes - 1, 1).bit_length()
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        if buffer.device.type == "cpu":
            buffer.numpy().fill(0)  # touched now, once (numpy: no OpenMP pool)
        else:
            buffer.zero_()
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """A buffer no send or receive reads or writes any more: kept for a later batch (the largest few)."""
        self._free.append(buffer)
        self._free.sort(key=torch.Tensor.numel, reverse=True)
        del self._free[KEPT:]
