"""The machine's memory shared by every copy of the suite running on it, in GiB: a test that starts vLLM engines
takes its share (``memory_share``) before it starts them and gives it back once they are gone, and a test process
that starts engines holds a share for itself and its fork server for the rest of its life
(``hold_for_this_process``). Two copies of the suite side by side on the 24 GiB, 2-core machine then wait for each
other's engines instead of filling the machine (they did: the kernel's OOM killer ended engine processes).

The shares are slots, one file a GiB in the machine's temporary folder, each taken with an exclusive ``flock``: a
holder that dies, however it dies, gives its slots back. A request takes all its slots at once or none, so no holder
waits while it holds part of what it needs; waiters are served in turn (whoever holds the turnstile lock takes the
next free slots), so a large share is not passed over for ever by small ones. The slots are the machine's memory
less ``SYSTEM_GIB``; a request larger than what the test processes' own shares can leave free is cut to that (on a
machine too small for it, the suite would fill the memory anyway).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from tests.support.deadlines import patient
from tests.support.machine_lock import try_flock

log = logging.getLogger(__name__)

SYSTEM_GIB = 3  # the kernel, the pytest controllers, the test processes that start no engine and their daemons (the
# e2e files: 1.4 GiB each at their peak, 2026-12-07)
PROCESS_GIB = 2  # a test process that imported vLLM (about 0.7 GiB) with its fork server (about 1.6, partly shared)
MOST_PROCESSES = 4  # two copies of the suite, two workers each (the README's ``-n 2``)
WAIT_PERIOD_S = 0.5
SHARE_WAIT_S = 1500.0  # the longest another copy's engines may keep the memory (its TP classes, loaded: 5-10 min)

_held_for_process: list[IO] = []  # this process's own share, let go when it exits


def _folder() -> Path:
    folder = Path(tempfile.gettempdir()) / "kpool-pd-tests-memory"
    folder.mkdir(exist_ok=True)
    return folder


def machine_gib() -> int:
    """The machine's memory in whole GiB (``MemTotal``)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // (1024 * 1024)
    raise RuntimeError("/proc/meminfo has no MemTotal line")


def slot_count() -> int:
    return max(1, machine_gib() - SYSTEM_GIB)


def largest_share() -> int:
    """The most one request may take: what every test process's own share leaves of the slots."""
    return max(1, slot_count() - MOST_PROCESSES * PROCESS_GIB)


def _release(handles: list[IO]) -> None:
    for handle in handles:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _take_all_or_none(gib: int) -> list[IO] | None:
    """``gib`` free slots, locked, or None (and nothing held) when fewer are free."""
    taken: list[IO] = []
    for index in range(slot_count()):
        handle = open(_folder() / f"slot-{index}.lock", "a+")
        if try_flock(handle):
            taken.append(handle)
            if len(taken) == gib:
                return taken
        else:
            handle.close()
    _release(taken)
    return None


def _take(gib: int, within_s: float, what: str) -> list[IO]:
    """Wait in turn for ``gib`` slots (at most ``patient(within_s)``); AssertionError naming ``what`` after it."""
    gib = min(gib, largest_share())
    deadline = time.monotonic() + patient(within_s)
    started = time.monotonic()
    with open(_folder() / "turnstile.lock", "a+") as turnstile:
        while not try_flock(turnstile):
            assert time.monotonic() < deadline, f"{what}: waited past the deadline for the turn to take {gib} GiB"
            time.sleep(WAIT_PERIOD_S)
        try:
            while (taken := _take_all_or_none(gib)) is None:
                assert time.monotonic() < deadline, \
                    f"{what}: {gib} GiB of the machine's {slot_count()} were not free before the deadline"
                time.sleep(WAIT_PERIOD_S)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
    waited_s = time.monotonic() - started
    if waited_s > 1.0:
        log.info("%s waited %.1f s for %d GiB of the machine's memory", what, waited_s, gib)
    return taken


@contextlib.contextmanager
def memory_share(gib: int, what: str, within_s: float = SHARE_WAIT_S) -> Iterator[None]:
    """Hold ``gib`` GiB of the machine's slots for the block (``what`` names the holder in a deadline's message),
    this process's own share taken first (``hold_for_this_process``). Shares are not nested: a block that needs
    more takes it all at once."""
    if gib < 1:
        raise ValueError(f"a memory share is at least 1 GiB, got {gib}")
    hold_for_this_process(within_s)
    taken = _take(gib, within_s, what)
    try:
        yield
    finally:
        _release(taken)


def hold_for_this_process(within_s: float) -> None:
    """Take this test process's own share (``PROCESS_GIB``) once, held until the process ends."""
    if not _held_for_process:
        _held_for_process.extend(_take(PROCESS_GIB, within_s, f"test process {os.getpid()}"))


def module_memory(gib: int, what: str):
    """A module-scoped fixture named ``vllm_memory`` that holds ``gib`` GiB from its first user's setup to the
    module's end, for a test file whose fixtures' engines live side by side: those fixtures ask for it first."""
    @pytest.fixture(scope="module", name="vllm_memory")
    def holding() -> Iterator[None]:
        with memory_share(gib, what):
            yield
    return holding
