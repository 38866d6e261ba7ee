"""The kernel bench's timing harness: a case, its prepared call, CUDA graph replay timed with events
(median of many), and the table rows of a run.

Two methods, as the cases ask:
- ``throughput``: one call a graph replay; the L2 is flushed before each replay when the case's bytes
  would fit in it. Bandwidth (bytes that must move / time) is what counts.
- ``decode``: a decode-time kernel, timed both ways: ``graph32`` captures 32 calls in one graph and
  reports the time per call (steady state: launches back to back, inputs warm in L2), and ``flush1``
  replays a graph of one call after an L2 flush each time (a cold call: launch latency plus DRAM).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

L2_BYTES = 50 * 2**20  # H200: 50 MiB; a throughput case whose bytes fit in twice this is timed after an L2 flush
GRAPH_CALLS = 32  # calls captured in one graph by the decode method's graph32 timing


@dataclass(frozen=True)
class Prepared:
    run: Callable[[], None]
    bytes_moved: int  # by one call


@dataclass(frozen=True, kw_only=True)
class BenchCase:
    """``make(device)`` allocates the inputs once and returns the call to time and the bytes one call must
    move (each input read once, each output written once). A decode case is timed by both methods; its
    targets are per method (``target_graph32_us``, ``target_flush1_us``); a throughput case's target is a
    time or a fraction of the device copy bandwidth."""

    name: str
    size: str
    make: Callable[[torch.device], Prepared]
    decode: bool = False
    target_us: float | None = None
    target_copy_fraction: float | None = None
    target_graph32_us: float | None = None
    target_flush1_us: float | None = None
    anchor: str = ""  # the reference implementation's figure, with where it comes from
    anchor_flush1: str = ""


def _capture(run: Callable[[], None], calls: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    torch.cuda.synchronize()
    return graph


def time_graph(run: Callable[[], None], *, flush: torch.Tensor | None, reps: int, calls: int = 1) -> float:
    """Median microseconds of one replay of a graph of ``calls`` calls, timed with CUDA events (the L2 flush
    stays outside the timed span)."""
    graph = _capture(run, calls)
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


def _row(case: BenchCase, method: str, us: float, moved: int, copy_bps: float, flushed: bool,
         target: float | None, fraction: float | None, anchor: str) -> dict:
    bps = moved / (us * 1e-6)
    met = None
    if target is not None:
        met = us <= target
    elif fraction is not None:
        met = bps / copy_bps >= fraction
    text = f"<= {target} us" if target is not None else (f">= {fraction:.0%} of copy" if fraction is not None else "")
    return {"kernel": case.name, "size": case.size, "method": method, "time_us": round(us, 3), "bytes": moved,
            "bandwidth_GBps": round(bps / 1e9, 1), "fraction_of_copy": round(bps / copy_bps, 3), "l2_flushed": flushed,
            "target": text, "met": met, "anchor": anchor}


def _failed(case: BenchCase, method: str, error: Exception) -> dict:
    print(f"{case.name} ({method}): failed: {error!r}", file=sys.stderr)
    return {"kernel": case.name, "size": case.size, "method": method, "time_us": float("nan"), "bytes": 0,
            "bandwidth_GBps": float("nan"), "fraction_of_copy": float("nan"), "l2_flushed": False, "target": "",
            "met": False, "anchor": "", "error": repr(error)}


def run_cases(cases: list[BenchCase], device: torch.device, copy_bps: float, reps: int) -> list[dict]:
    flush = torch.empty(4 * L2_BYTES, dtype=torch.uint8, device=device)
    rows = []
    for case in cases:
        try:
            prepared = case.make(device)
        except Exception as error:  # one failing case must not hide the others' figures
            rows.append(_failed(case, "make", error))
            continue
        if case.decode:
            timings = (("graph32", GRAPH_CALLS, None, case.target_graph32_us, case.anchor),
                       ("flush1", 1, flush, case.target_flush1_us, case.anchor_flush1))
            for method, calls, flush_with, target, anchor in timings:
                try:
                    us = time_graph(prepared.run, flush=flush_with, reps=reps, calls=calls) / calls
                except Exception as error:
                    rows.append(_failed(case, method, error))
                    continue
                rows.append(_row(case, method, us, prepared.bytes_moved, copy_bps, flush_with is not None, target,
                                 None, anchor))
        else:
            small = prepared.bytes_moved < 2 * L2_BYTES
            try:
                us = time_graph(prepared.run, flush=flush if small else None, reps=reps)
                rows.append(_row(case, "throughput", us, prepared.bytes_moved, copy_bps, small, case.target_us,
                                 case.target_copy_fraction, case.anchor))
            except Exception as error:
                rows.append(_failed(case, "throughput", error))
        del prepared
        torch.cuda.empty_cache()
    return rows
