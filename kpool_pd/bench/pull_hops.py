"""The transfer bench's per-pull hop timeline (``kpool_pd.bench.transfer --hops``): when each pull passed each hop
on the decode and the prefill node (``kpool_pd.connector.shared.hops``), in ms from the bench's call of ``pull``,
median over the timed pulls of one size and transport."""

from __future__ import annotations

import statistics

from kpool_pd.connector import HOPS


def hop_offsets(starts: dict[str, float], *stamps: dict[str, dict[str, float]]) -> dict[str, float]:
    """Median ms from each pull's start (``starts[grant_id]``, perf_counter seconds) to each hop it passed,
    from the stamps of both processes (``HopRecorder.stamps``); the hops in ``HOPS`` order, then
    ``end`` when ``starts`` had them."""
    offsets: dict[str, list[float]] = {}
    for grant_id, t0 in starts.items():
        for process in stamps:
            for hop, when in process.get(grant_id, {}).items():
                offsets.setdefault(hop, []).append((when - t0) * 1e3)
    return {hop: round(statistics.median(offsets[hop]), 3) for hop in HOPS if hop in offsets}


def thread_work(grant_ids, stamps: dict[str, dict[str, float]], cpu: dict[str, dict[str, float]], first: str,
                last: str) -> dict[str, float] | None:
    """Median wall ms and median CPU ms of the stamping thread from hop ``first`` to hop ``last`` over the pulls
    ``grant_ids`` that passed both, stamped by one thread of this process (``HopRecorder.stamps`` and ``.cpu``):
    CPU well below wall says the thread waited there (a lock, the GIL, the driver). None where no pull passed both."""
    wall, work = [], []
    for grant_id in grant_ids:
        when, used = stamps.get(grant_id, {}), cpu.get(grant_id, {})
        if first in when and last in when and first in used and last in used:
            wall.append((when[last] - when[first]) * 1e3)
            work.append((used[last] - used[first]) * 1e3)
    if not wall:
        return None
    return {"wall_ms": round(statistics.median(wall), 3), "cpu_ms": round(statistics.median(work), 3)}


def hop_lines(rows: list[dict]) -> str:
    """One line per row that has hops: each hop's median ms from the call of ``pull``, and the pull's."""
    lines = ["where a pull's time went, hop by hop (ms from the call of pull, median; decode: pull request posted "
             "written received prefilled landed returned; prefill: read checked lent prompt send completed "
             "announced sent)"]
    for r in rows:
        if "hops_ms" in r:
            hops = " ".join(f"{hop} {ms:.3f}" for hop, ms in r["hops_ms"].items())
            lines.append(f"{r['tokens']:>7} {r['path']:<20} {hops}  | end {r['ms']:.3f}")
    return "\n".join(lines)
