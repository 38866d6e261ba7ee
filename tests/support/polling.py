"""Waiting on a condition in tests, with a deadline."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest


def wait_for(predicate, timeout_s: float = 15.0, period_s: float = 0.1) -> bool:
    """Poll ``predicate`` every ``period_s`` until it is true or ``timeout_s`` passed; its last value."""
    deadline = time.monotonic() + timeout_s
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
    test naming ``what`` when ``timeout_s`` passed first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await predicate():
        if loop.time() > deadline:
            pytest.fail(f"{what} did not happen within {timeout_s} s")
        await asyncio.sleep(period_s)
