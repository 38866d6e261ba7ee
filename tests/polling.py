"""Waiting on a condition in tests, with a deadline."""

from __future__ import annotations

import time


def wait_for(predicate, timeout_s: float = 15.0, period_s: float = 0.1) -> bool:
    """Poll ``predicate`` every ``period_s`` until it is true or ``timeout_s`` passed; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period_s)
    return predicate()
