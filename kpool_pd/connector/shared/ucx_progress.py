"""How this process's UCX worker is progressed: ucxx's progress thread, sleeping in epoll between events or
spinning.

ucxx's default progress thread (``thread``) waits in ``epoll_wait`` with a 1 ms timeout between worker events.
A message over tcp wakes it, but the end of a cuda_ipc copy is seen at the thread's next pass: on one H100
(2026-12-07, both processes on cuda:0, 61 layers, 41 MiB) a connector pull's send took 0.75 ms from post to
completion with it and 0.32 ms with the spinning thread (``thread-polling``), the cold pull 1.83 against 1.18 ms,
a push's exposed time 1.20 against 0.69 ms, in one call of ``bench.transfer`` (README, "The transfer"). The
spinning thread keeps one core busy for as long as the process lives, so ``AUTO`` spins only where the pool is on
a GPU and the process may run on at least ``POLLING_MIN_CORES`` cores; on a host-memory pool (tcp, where a
message wakes the thread anyway) or a small machine it would take a core from the work (on the 2-core CPU
machine a spinning thread made a 0.3 MiB pull 4x slower).

An operator's ``UCXPY_PROGRESS_MODE`` (ucxx's own variable: ``thread``, ``thread-polling``, ``polling``,
``blocking``) wins over the connector's choice, as ``UCX_<KEY>`` variables win over its UCX options.
"""

from __future__ import annotations

import enum
import os

PROGRESS_ENV = "UCXPY_PROGRESS_MODE"
POLLING_MIN_CORES = 8  # AUTO spins only where the process may use at least this many cores


class UcxProgress(enum.Enum):
    """The connector's choice of ucxx progress mode (``ConnectorConfig.ucx_progress``)."""

    AUTO = "auto"  # THREAD_POLLING for a GPU pool on a machine of POLLING_MIN_CORES cores or more, else THREAD
    THREAD = "thread"  # ucxx's default: a progress thread that sleeps in epoll between worker events
    THREAD_POLLING = "thread-polling"  # a progress thread that spins: the lowest latency, one core kept busy


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        return os.cpu_count() or 1


def progress_mode_for(progress: UcxProgress, device_type: str, *, cores: int | None = None,
                      environ: dict[str, str] | None = None) -> str | None:
    """ucxx's progress mode for a node whose pool lives on ``device_type`` ("cpu", "cuda"): None where the
    operator set ``UCXPY_PROGRESS_MODE`` (ucxx then reads it itself), else ``progress``'s mode (``AUTO`` resolved
    against ``device_type`` and ``cores``, default: ``usable_cores()``). TypeError unless ``progress`` is a
    ``UcxProgress``."""
    if not isinstance(progress, UcxProgress):
        raise TypeError(f"progress must be a UcxProgress, got {progress!r}")
    if (environ if environ is not None else os.environ).get(PROGRESS_ENV):
        return None
    if progress is not UcxProgress.AUTO:
        return progress.value
    cores = usable_cores() if cores is None else cores
    spins = device_type == "cuda" and cores >= POLLING_MIN_CORES
    return (UcxProgress.THREAD_POLLING if spins else UcxProgress.THREAD).value
