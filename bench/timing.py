"""The kernel bench's timing harness: a case, its prepared call, CUDA graph replay timed with events
(median of many, L2 flushed for cases that would fit in it), and the table rows of a run."""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

L2_BYTES = 50 * 2**20  # H200: 50 MiB; a case whose bytes fit in twice this is timed after an L2 flush


@dataclass(frozen=True)
class Prepared:
    run: Callable[[], None]
    bytes_moved: int
    calls_per_replay: int = 1  # several calls captured in one graph: time is reported per call


@dataclass(frozen=True)
class BenchCase:
    """``make(device)`` allocates the inputs once and returns the call to time and the bytes it must
    move (each input read once, each output written once)."""

    name: str
    size: str
    make: Callable[[torch.device], Prepared]
    target_us: float | None = None  # figure to reach: time at most this
    target_copy_fraction: float | None = None  # figure to reach: bandwidth at least this fraction of copy
    anchor: str = ""  # the reference implementation's figure on this device, for comparison


def _capture(run: Callable[[], None]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    torch.cuda.synchronize()
    return graph


def time_graph(run: Callable[[], None], *, flush: torch.Tensor | None, reps: int) -> float:
    """Median microseconds of one graph replay, timed with CUDA events (the L2 flush stays outside)."""
    graph = _capture(run)
    for _ in range(5):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def run_cases(cases: list[BenchCase], device: torch.device, copy_bps: float, reps: int) -> list[dict]:
    flush = torch.empty(4 * L2_BYTES, dtype=torch.uint8, device=device)
    rows = []
    for case in cases:
        try:
            prepared = case.make(device)
            small = prepared.bytes_moved < 2 * L2_BYTES * prepared.calls_per_replay
            replay_us = time_graph(prepared.run, flush=flush if small else None, reps=reps)
        except Exception as error:  # one failing case must not hide the others' figures
            print(f"{case.name}: failed: {error!r}", file=sys.stderr)
            rows.append({"kernel": case.name, "size": case.size, "time_us": float("nan"), "bytes": 0,
                         "bandwidth_GBps": float("nan"), "fraction_of_copy": float("nan"), "l2_flushed": False,
                         "target": _target_text(case), "met": False, "anchor": case.anchor, "error": repr(error)})
            continue
        us = replay_us / prepared.calls_per_replay
        bps = prepared.bytes_moved / prepared.calls_per_replay / (us * 1e-6)
        met = None
        if case.target_us is not None:
            met = us <= case.target_us
        elif case.target_copy_fraction is not None:
            met = bps / copy_bps >= case.target_copy_fraction
        rows.append({
            "kernel": case.name, "size": case.size, "time_us": round(us, 3), "bytes": prepared.bytes_moved //
            prepared.calls_per_replay, "bandwidth_GBps": round(bps / 1e9, 1), "fraction_of_copy": round(bps / copy_bps, 3),
            "l2_flushed": small, "target": _target_text(case), "met": met, "anchor": case.anchor,
        })
        del prepared
        torch.cuda.empty_cache()
    return rows


def _target_text(case: BenchCase) -> str:
    if case.target_us is not None:
        return f"<= {case.target_us} us"
    if case.target_copy_fraction is not None:
        return f">= {case.target_copy_fraction:.0%} of copy"
    return ""
