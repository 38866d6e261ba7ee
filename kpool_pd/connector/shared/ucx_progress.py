"""How this process's UCX worker is progressed: ucxx's progress thread, sleeping in epoll between events or
spinning.

ucxx's default progress thread (``thread``) waits in ``epoll_wait`` (1 ms at most) between worker events; the
spinning one (``thread-polling``) never waits. On one H100 (2026-12-07, both processes on cuda:0, 61 layers) a
connector pull's send at 41 MiB took 0.75 ms from post to completion with the sleeping thread and 0.32 ms with the
spinning one; side by side, twice (``bench/results/transfer-2026-12-07-h100-progress-53cd4ef.txt``), the spinning
thread shortened a push's exposed time in five of six pairs (1,024 / 4,096 / 32,768 tokens), by 0.18-0.67 ms. Why the
sleeping thread is late is not isolated (a cuda_ipc copy's end does not seem to wake it). The spinning thread keeps
one core busy for as long as the process lives, so ``AUTO`` spins only where the pool is on a GPU and the process may
keep at least ``POLLING_MIN_CORES`` cores busy (its affinity, capped by its cgroup's CPU quota: a pod's
``limits.cpu``); on a host-memory pool or a small machine it would take a core from the work (on the 2-core CPU
machine a spinning thread made a 0.3 MiB pull 4x slower).

An operator's ``UCXPY_PROGRESS_MODE`` (ucxx's own variable: ``thread``, ``thread-polling``, ``polling``,
``blocking``) wins over the connector's choice, as ``UCX_<KEY>`` variables win over its UCX options.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

PROGRESS_ENV = "UCXPY_PROGRESS_MODE"
POLLING_MIN_CORES = 8  # AUTO spins only where the process may use at least this many cores


class UcxProgress(enum.Enum):
    """The connector's choice of ucxx progress mode (``ConnectorConfig.ucx_progress``)."""

    AUTO = "auto"  # THREAD_POLLING for a GPU pool on a machine of POLLING_MIN_CORES cores or more, else THREAD
    THREAD = "thread"  # ucxx's default: a progress thread that sleeps in epoll between worker events
    THREAD_POLLING = "thread-polling"  # a progress thread that spins: the lowest latency, one core kept busy


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in cores (a pod's ``limits.cpu``), None where there is none: cgroup v2's
    ``cpu.max`` ("max 100000" or "<quota> <period>"), else v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        if int(quota) > 0 and int(period) > 0:
            return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def usable_cores(root: Path = CGROUP_ROOT) -> int:
    """The cores this process may keep busy: its affinity mask (else the machine's count), capped by its cgroup's
    CPU quota (rounded down, at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    return cores if limit is None else max(1, min(cores, int(limit)))


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


def describe_progress_mode(progress: UcxProgress, device_type: str) -> str:
    """The mode ``progress_mode_for`` gives a node with its pool on ``device_type`` here, and why, in words."""
    cores = usable_cores()  # read once: the quota's files are read for the choice and the words alike
    chosen = progress_mode_for(progress, device_type, cores=cores)
    if chosen is None:
        return f"{os.environ[PROGRESS_ENV]} ({PROGRESS_ENV})"
    why = "the connector's default" if progress is UcxProgress.AUTO else f"ucx_progress={progress.name}"
    return f"{chosen} ({why} for a {device_type} pool on {cores} cores)"
