"""What the decode and prefill graphs share: a forward's inputs packed in one int64 buffer (pinned on the host,
persistent on the device, copied over in one transfer), and the capture of a forward into a CUDA graph."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

Result = TypeVar("Result")


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


def capture(forward: Callable[[], Result], memory, device: torch.device) -> tuple[torch.cuda.CUDAGraph, Result]:
    """Run ``forward`` once on a side stream (it compiles every kernel outside the capture), then capture it into
    a graph whose memory comes from the pool ``memory`` (``torch.cuda.graph_pool_handle``); returns the graph and
    what the captured call returned (tensors that each replay overwrites)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=memory):
        result = forward()
    return graph, result


def padded_rows(rows: Sequence[Sequence[int]], width: int) -> list[int]:
    """``rows`` (each at most ``width`` long) flattened row after row, each padded with -1 to ``width``."""
    flat: list[int] = []
    for row in rows:
        flat.extend(row)
        flat.extend([-1] * (width - len(row)))
    return flat
