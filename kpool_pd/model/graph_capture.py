"""What the decode and prefill graphs share: a forward's inputs packed in one int64 buffer (pinned on the host,
persistent on the device, copied over in one transfer), and the capture of a forward into a CUDA graph."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch

Result = TypeVar("Result")

# A request's part of a step: (token ids, first position, block ids, ring id), as model.batch.build_batch takes.
Chunk = tuple[Sequence[int], int, Sequence[int], int]


def bucket_size(count: int) -> int:
    """The smallest power of two >= count (>= 1): the padded size of a graph's batch."""
    return 1 << max(count - 1, 0).bit_length()


def request_buckets(max_requests: int) -> list[int]:
    """The request counts graphs are captured for: 1, 2, 4, .. up to ``max_requests`` (which closes the list)."""
    buckets = [1 << i for i in range(max(max_requests - 1, 0).bit_length()) if 1 << i < max_requests]
    return buckets + [max_requests]


class PackedInput:
    """Int64 fields of the given sizes, back to back: ``host`` fields are written, ``upload`` copies them all to
    the ``device`` fields (which a captured graph reads) without a host synchronisation."""

    def __init__(self, sizes: Sequence[int], device: torch.device) -> None:
        self.sizes = tuple(sizes)
        self._host = torch.empty(sum(self.sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
        self._device = torch.empty(sum(self.sizes), dtype=torch.int64, device=device)

    def host(self) -> list[torch.Tensor]:
        """The host fields, in order. # -> [sizes[i]] int64 each"""
        return list(self._host.split(self.sizes))

    def device(self) -> list[torch.Tensor]:
        """The device fields, in order. # -> [sizes[i]] int64 each"""
        return list(self._device.split(self.sizes))

    def upload(self) -> None:
        self._device.copy_(self._host, non_blocking=True)


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No garbage collection inside: Python's collector, run by an allocation, may free a dead cycle that holds a
    CUDA graph, and the graph's reset (its memory given back) is an operation a stream capture forbids."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture(forward: Callable[[], Result], memory, device: torch.device) -> tuple[torch.cuda.CUDAGraph, Result]:
    """Run ``forward`` once on a side stream (it compiles every kernel outside the capture), then capture it into
    a graph whose memory comes from the pool ``memory`` (``torch.cuda.graph_pool_handle``); returns the graph and
    what the captured call returned (tensors that each replay overwrites).

    The capture checks this thread only (``thread_local``): a decode node captures while other threads of its
    process may use the device (UCX's progress thread, a pull landing), and in the default global mode such a call
    from another thread invalidates the capture. And no garbage is collected while it runs
    (``collection_paused``): the GPU suite (``-n 8``, H100, 2026-12-07, twice) saw ``cudaErrorStreamCaptureInvalidated``
    in ``test_graphed_decode_equals_eager[4-3]`` beside CUDA's warning "operation not permitted when stream is
    capturing (function reset)": a collection inside the capture freed an earlier engine's graph (torch's
    ``torch.cuda.graph`` no longer collects before it captures)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with collection_paused(), torch.cuda.graph(graph, pool=memory, capture_error_mode="thread_local"):
        result = forward()
    return graph, result


def padded_rows(rows: Sequence[Sequence[int]], width: int) -> list[int]:
    """``rows`` (each at most ``width`` long) flattened row after row, each padded with -1 to ``width``."""
    flat: list[int] = []
    for row in rows:
        flat.extend(row)
        flat.extend([-1] * (width - len(row)))
    return flat


def table_width(chunks: Sequence[Chunk], block_size: int) -> int:
    """The block-table columns a step of ``chunks`` (token ids, first position, block ids, ring id) needs: each
    chunk's blocks, and at least those its last position lies in."""
    return max(max(len(blocks), -(-(start + len(ids)) // block_size)) for ids, start, blocks, _ in chunks)
