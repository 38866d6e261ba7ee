"""`kpool-pd up` leaves nothing behind, as real processes: SIGTERM, SIGINT or SIGHUP, at any stage
of a run, stops the daemons and removes its temporary folder (with ``--tls``, the throwaway CA key with
it) within a few seconds; SIGKILL, which it cannot catch, still leaves no daemon running (each
gets SIGTERM when its parent dies, and drains). Daemons are found as the children of ``up``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.polling import process_alive, wait_for

GONE_WITHIN_S = 10.0  # both daemons drain and exit, on 2 busy cores
# Without `up` to SIGKILL them after its grace, the daemons bound their own exit: a drain of at most
# --drain-s (30 s by default) for the dead client's calls, then the close; on a loaded 2-core machine the
# cancels can take more than 10 s to reach them (seen in CI).
DRAINED_WITHIN_S = 30.0 + 30.0
BOOT_S = 120.0
# Long enough that the daemons are still busy when the signal comes; short prompts keep it cheap.
RUN = ["--transport", "grpc", "--requests", "2", "--prompt-len", "16", "--max-tokens", "400"]


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _start_up(tmp_path: Path, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where `up` makes its folder
    return subprocess.Popen([sys.executable, "-m", "kpool_pd", "up", *RUN, *flags], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _run_folder(tmp_path: Path) -> Path:
    assert wait_for(lambda: len(list(tmp_path.glob("kpool-pd-up-*"))) == 1, 30), list(tmp_path.iterdir())
    return next(tmp_path.glob("kpool-pd-up-*"))


STAGES = {  # how far `up` got: a file that exists by then, and how many daemons run
    "prefill-starting": (None, 1),
    "decode-starting": ("prefill.ready.json", 2),
    "running": ("decode.ready.json", 2),
}


def _wait_for_daemons(up: subprocess.Popen, folder: Path, stage: str) -> list[int]:
    """The pids of the daemons `up` started, once it reached ``stage``."""
    ready, count = STAGES[stage]
    assert wait_for(lambda: (ready is None or (folder / ready).exists()) and len(_children(up.pid)) == count,
                    BOOT_S, 0.05), f"not {stage}: {up.poll()} {up.stderr.read() if up.poll() is not None else ''}"
    return _children(up.pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds daemons through /proc")
@pytest.mark.parametrize("sig,flags,stage", [
    pytest.param(signal.SIGTERM, ("--tls",), "running", id="sigterm-mid-run-tls"),
    pytest.param(signal.SIGHUP, (), "decode-starting", id="sighup-while-the-decode-daemon-starts"),
    pytest.param(signal.SIGINT, (), "prefill-starting", id="sigint-while-the-prefill-daemon-starts"),
])
def test_a_signal_stops_the_daemons_and_removes_the_folder(tmp_path, sig, flags, stage):
    up = _start_up(tmp_path, *flags)
    try:
        folder = _run_folder(tmp_path)
        pids = _wait_for_daemons(up, folder, stage)
        if "--tls" in flags:
            assert (folder / "ca.key").exists()
        up.send_signal(sig)
        assert up.wait(GONE_WITHIN_S) == 128 + sig, up.stderr.read()
        assert not [p for p in pids if process_alive(p)], "daemons left running"
        assert not folder.exists(), sorted(p.name for p in folder.iterdir())
        assert f"{sig.name}: stopping the daemons" in up.stderr.read()
    finally:
        up.kill()
        up.wait(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")
def test_daemons_exit_by_themselves_when_up_is_killed(tmp_path):
    up = _start_up(tmp_path)
    pids: list[int] = []
    try:
        pids = _wait_for_daemons(up, _run_folder(tmp_path), "running")
        up.kill()
        up.wait(10)
        assert wait_for(lambda: not [p for p in pids if process_alive(p)], DRAINED_WITHIN_S), "daemons outlived `up`"
    finally:
        for pid in pids:  # never leave one behind, even when the test fails
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
