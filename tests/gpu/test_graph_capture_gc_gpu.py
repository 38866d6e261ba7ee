"""A CUDA graph capture (``kpool_pd.model.graph_capture.capture``) survives Python's garbage collector: a dead
cycle holding an earlier graph, collected while the next graph is captured, would reset that graph inside the
capture (an operation a capture forbids) and invalidate it. The collector is made to run at every allocation, and
the capture's call drops the last reference to such a cycle; the captured graph must then replay correctly."""

from __future__ import annotations

import gc

import pytest
import torch

from kpool_pd.model.graph_capture import capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class _Holder:
    """Holds a captured graph in a reference cycle: only the collector frees it."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.me = graph, self


def test_a_collection_during_the_capture_frees_no_graph_into_it():
    device = torch.device("cuda")
    x = torch.arange(8, device=device, dtype=torch.float32)
    old, _ = capture(lambda: x + 1, torch.cuda.graph_pool_handle(), device)
    held = [_Holder(old)]
    del old
    calls = []

    def forward():
        calls.append(len(calls))
        if len(calls) == 2:  # the captured call: the old graph's holder becomes garbage, and allocations follow
            held.clear()
            _ = [[] for _ in range(2000)]
        return x * 2

    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(1, 1, 1)  # a collection at (nearly) every allocation
    try:
        graph, out = capture(forward, torch.cuda.graph_pool_handle(), device)
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()  # the old graph goes now, outside any capture
    x.add_(1)
    graph.replay()
    torch.cuda.synchronize(device)
    assert len(calls) == 2
    assert torch.equal(out, torch.arange(1, 9, device=device, dtype=torch.float32) * 2)
