"""Waiting on a condition in tests, under a deadline stretched for the load (``tests.support.deadlines``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.support.deadlines import patient


def wait_for(predicate, timeout_s: float = 15.0, period_s: float = 0.1) -> bool:
    """Poll ``predicate`` every ``period_s`` until it is true or its deadline passed (``timeout_s`` on an idle
    machine, ``patient(timeout_s)`` here); its last value."""
    deadline = time.monotonic() + patient(timeout_s)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period_s)
    return predicate()


def process_alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


async def until(predicate, what: str, timeout_s: float, period_s: float = 0.05) -> None:
    """Await ``predicate()`` (a coroutine function) every ``period_s`` until it is true; fail the
    test naming ``what`` when its deadline (``patient(timeout_s)``) passed first."""
    loop = asyncio.get_running_loop()
    allowed_s = patient(timeout_s)
    deadline = loop.time() + allowed_s
    while not await predicate():
        if loop.time() > deadline:
            pytest.fail(f"{what} did not happen within {allowed_s:.1f} s")
        await asyncio.sleep(period_s)
