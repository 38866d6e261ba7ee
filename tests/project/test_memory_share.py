"""The suite's machine-wide memory shares (tests/support/memory_share.py): all or none, given back when the holder
ends however it ends, and a clear message when the deadline passes. Each test has its own slots (a folder of its own,
four slots)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support import memory_share
from tests.support.paths import REPO
from tests.support.polling import wait_for

SLOTS = 4


@pytest.fixture
def slots(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_share, "_folder", lambda: tmp_path)
    monkeypatch.setattr(memory_share, "slot_count", lambda: SLOTS)
    monkeypatch.setattr(memory_share, "largest_share", lambda: SLOTS)
    monkeypatch.setattr(memory_share, "_held_for_process", [])
    monkeypatch.setattr(memory_share, "PROCESS_GIB", 1)
    yield tmp_path
    memory_share._release(memory_share._held_for_process)


def free_slots(folder) -> int:
    """How many of the folder's slots another process could take now."""
    code = textwrap.dedent(f"""
        import fcntl
        free = 0
        for index in range({SLOTS}):
            with open({str(folder)!r} + f"/slot-{{index}}.lock", "a+") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                free += 1
        print(free)
    """)
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def test_a_share_holds_its_slots_and_gives_them_back(slots):
    with memory_share.memory_share(2, "the first"):
        assert free_slots(slots) == SLOTS - 1 - 2  # this process's own share, then the block's
    assert free_slots(slots) == SLOTS - 1  # this process's own share stays


def test_a_share_larger_than_what_is_free_waits_then_fails_naming_the_holder_and_the_sizes(slots):
    with memory_share.memory_share(2, "the first"):
        with pytest.raises(AssertionError, match=r"the second: 2 GiB of the machine's 4 were not free"):
            with memory_share.memory_share(2, "the second", within_s=1.0):
                pass
        assert free_slots(slots) == SLOTS - 1 - 2  # the refused request holds nothing


def test_a_killed_holder_gives_its_slots_back(slots):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from tests.support import memory_share
        memory_share._folder = lambda: __import__("pathlib").Path({str(slots)!r})
        memory_share.slot_count = lambda: {SLOTS}
        memory_share.largest_share = lambda: {SLOTS}
        memory_share.PROCESS_GIB = 1
        with memory_share.memory_share(3, "the holder", within_s=60):
            print("held", flush=True)
            time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert free_slots(slots) == 0  # its own share and the block's
    finally:
        holder.kill()
        holder.wait(60)
    assert wait_for(lambda: free_slots(slots) == SLOTS, 30)
    with memory_share.memory_share(3, "the next", within_s=5.0):
        assert free_slots(slots) == 0


def test_a_share_below_one_gib_is_refused(slots):
    with pytest.raises(ValueError, match="at least 1 GiB, got 0"):
        with memory_share.memory_share(0, "nothing"):
            pass
