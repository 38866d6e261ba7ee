"""Stall probes for ``kpool_pd.bench.vllm_trace``: where an engine process stops running the connector's work.

Two probes, each writing a ``stall`` event (``begin``, ``end``, ``kind``) for a gap over ``STALL_S``:

- ``sampler``: a thread that sleeps ``TICK_S`` and notes when it woke late. A late wake means no Python thread
  of the process could run it: the GIL held by another thread for that long, or the process not given a core.
- ``loop``: a task on the connector's event loop that sleeps ``TICK_S`` and notes when it ran late: the loop
  was kept from its callbacks (one of them ran long, or the loop's thread waited for the GIL or a core).

While the loop is late (``STALL_S``), the sampler thread writes the stacks of the process's threads once
(``stacks``: each thread's name and its innermost frames), so that a trace says what held the loop.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections.abc import Callable

TICK_S = 0.002  # how often each probe looks
STALL_S = 0.03  # a gap longer than this is written
FRAMES = 6  # innermost frames kept of each thread's stack


class StallProbe:
    """The two probes of one process, writing through ``write(kind, **fields)``."""

    def __init__(self, write: Callable[..., None]) -> None:
        self._write = write
        self._loop_beat = time.perf_counter()
        self._loop_thread: int | None = None
        self._dumped = False
        self._closed = threading.Event()
        threading.Thread(target=self._sample, name="kpoolpd-stall-sampler", daemon=True).start()

    def close(self) -> None:
        """Stop both probes (the loop's at its next tick)."""
        self._closed.set()

    def watch_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the loop probe on ``loop`` (running in another thread)."""
        asyncio.run_coroutine_threadsafe(self._beat(), loop)

    async def _beat(self) -> None:
        self._loop_thread = threading.get_ident()
        while not self._closed.is_set():
            before = time.perf_counter()
            self._loop_beat = before
            await asyncio.sleep(TICK_S)
            after = time.perf_counter()
            self._loop_beat = after
            self._dumped = False
            if after - before - TICK_S > STALL_S:
                self._write(kind="loop", begin=before, end=after)

    def _sample(self) -> None:
        last = time.perf_counter()
        while not self._closed.wait(TICK_S):
            now = time.perf_counter()
            if now - last - TICK_S > STALL_S:
                self._write(kind="sampler", begin=last, end=now)
            last = now
            if self._loop_thread is not None and not self._dumped and now - self._loop_beat > STALL_S:
                self._dumped = True
                self._write(kind="stacks", begin=self._loop_beat, end=now, stacks=_stacks())


def _stacks() -> dict[str, list[str]]:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        summary = traceback.extract_stack(frame)[-FRAMES:]
        out[f"{names.get(ident, '?')}:{ident}"] = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                                                   for f in summary]
    return out
