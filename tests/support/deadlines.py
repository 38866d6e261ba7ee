"""Deadlines for what a test waits on, stretched for a loaded machine.

A test waits on the condition itself (``polling.wait_for``, ``polling.until``, a child's message, a call
that ends when its work does), so a long deadline costs nothing when things go right: it only bounds
how long a failure takes to report. A test states the seconds its wait takes on an idle machine with
room to spare; ``patient`` turns them into the deadline it waits under: at least ``FLOOR`` times as
long (the load can rise after the wait began: another suite beside this one, engines starting), and
longer still in proportion to the load per core when the wait starts (``os.getloadavg``), up to
``CEILING_S`` (pytest-timeout fails a test after 300 s; the deadline should name the wait first).

A time the test itself measures (a lease that must run out, a deadline whose expiry is the behaviour
under test) is not a wait and is not stretched.
"""

from __future__ import annotations

import os

FLOOR = 3.0        # times the idle machine's seconds, whatever the load now
PER_LOAD = 2.0     # and this many times the load per core, when that is more
CEILING_S = 240.0  # never past this (a stated time above it is kept as it is)


def load_per_core() -> float:
    """Runnable tasks per core over the last minute."""
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def patient(seconds: float) -> float:
    """The deadline for a wait that takes ``seconds`` on an idle machine, stretched for the load now."""
    if seconds <= 0:
        raise ValueError(f"a wait takes a positive time, not {seconds} s")
    stretched = seconds * max(FLOOR, PER_LOAD * load_per_core())
    return max(seconds, min(stretched, CEILING_S))
