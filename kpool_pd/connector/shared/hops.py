"""A pull's hops, stamped for the transfer bench: where a UCX pull's time goes between the two nodes.

Each side stamps the moments a pull passes (``stamp(grant_id, hop)``) with ``time.perf_counter()``: on one
host both processes read the same CLOCK_MONOTONIC, so the stamps of the decode node and the prefill node line
up. ``HopRecorder`` is what the bench installs in each process to collect them (``kpool_pd.bench.transfer
--hops``): it is called directly, with no log record made, since a record cost 10-70 us a stamp (11 stamps a
pull), which the stamped pull then paid. Other tools may read them from the ``connector.hops`` logger at DEBUG
level. Off (no recorder, the logger not at DEBUG: the default), a stamp is two cheap tests.

The hops, in the order a UCX pull on a session passes them (``HOPS``): decode ``pull`` (InboundPull.run
begins), ``request`` (the pull's message handed to the session's writer), ``posted`` (its receives posted, once
gRPC has the request),
``written`` (the writer gave it to gRPC); prefill ``read`` (the session read it), ``checked`` (the pull
checked and planned), ``lent`` (its endpoint lent), ``prompt`` (a pipelined grant's: the engine said its
prompt's last chunk is written, where a push's exposed time begins), ``send`` (the first region's send handed
to UCX), ``completed`` (the last send's completion reached the event loop: its callback), ``announced``
(PrefillDone made, stating the times so far), ``sent`` (the pull saw every send complete: for a push, once its
PrefillDone went out too); decode ``received`` (every receive's completion reached the event loop: where the
exposed time ends), ``prefilled`` (PrefillDone arrived), ``landed`` (the last receive seen complete: for a
push, once its grant came), ``prepared`` and ``repacked`` (a pull from a peer of another layout: our block table on
the device, then the repack enqueued), ``returned`` (run returns).

A process that runs its event loop as a ``StepCountingLoop`` (the bench's prefill node, with --hops) also
stamps how many steps its loop had taken (a step: one pass over the callbacks ready then); ``HopRecorder.steps``
keeps them, so the bench can say in how many loop steps a pull went from one hop to another (a task that runs
on without waiting takes no step; each hand-over to another task or callback takes one).
"""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger("kpool_pd.connector.hops")

HOPS = ("pull", "request", "posted", "written", "read", "checked", "lent", "prompt", "send", "completed", "announced",
        "sent", "received", "prefilled", "landed", "prepared", "repacked", "returned")


_recorders: list["HopRecorder"] = []  # installed in this process (``HopRecorder.install``)


def stamp(grant_id: str, hop: str, when: float | None = None) -> None:
    """Record that ``grant_id``'s pull passed ``hop`` now (or at ``when``, a perf_counter time noted before)
    (nothing without a recorder installed or the hops logger at DEBUG), with its loop's step count (-1 unless the
    running loop is a ``StepCountingLoop``)."""
    if _recorders:
        steps = getattr(asyncio._get_running_loop(), "steps", -1)
        when = time.perf_counter() if when is None else when
        cpu = time.thread_time()
        for recorder in _recorders:
            recorder.record(grant_id, hop, when, steps, cpu)
    if logger.isEnabledFor(logging.DEBUG):
        loop = asyncio._get_running_loop()
        logger.debug("%s %s %.9f %d", grant_id, hop, time.perf_counter() if when is None else when,
                     getattr(loop, "steps", -1))


class StepCountingLoop(asyncio.SelectorEventLoop):
    """The default event loop, counting its steps (``steps``) for the hop stamps; instrumentation only (its
    count relies on the loop's private step method)."""

    steps = 0

    def _run_once(self) -> None:
        self.steps += 1
        super()._run_once()


class HopRecorder:
    """Collects the stamps of this process: ``stamps[grant_id][hop]`` is the first time (perf_counter
    seconds) that pull passed that hop, ``steps[grant_id][hop]`` its loop's step count then (a
    ``StepCountingLoop``'s only), ``cpu[grant_id][hop]`` the stamping thread's CPU seconds then. ``install()`` has ``stamp`` call it; ``uninstall()`` stops that."""

    def __init__(self) -> None:
        self.stamps: dict[str, dict[str, float]] = {}
        self.steps: dict[str, dict[str, int]] = {}  # the loop's step count at each hop, where counted
        # the stamping thread's CPU time (time.thread_time) at each hop: between two hops of one thread, set against
        # their wall time, it says whether the thread worked or waited (on a lock, the GIL, the driver)
        self.cpu: dict[str, dict[str, float]] = {}

    def record(self, grant_id: str, hop: str, when: float, steps: int, cpu: float = float("nan")) -> None:
        self.stamps.setdefault(grant_id, {}).setdefault(hop, when)
        self.cpu.setdefault(grant_id, {}).setdefault(hop, cpu)
        if steps >= 0:
            self.steps.setdefault(grant_id, {}).setdefault(hop, steps)

    def install(self) -> "HopRecorder":
        if self not in _recorders:
            _recorders.append(self)
        return self

    def uninstall(self) -> None:
        """Stop recording (idempotent)."""
        if self in _recorders:
            _recorders.remove(self)
