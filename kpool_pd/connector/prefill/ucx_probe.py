"""A UCX endpoint made first in a child process, so that a worker address that makes UCX abort
takes down the child, never the daemon.

``UcxProbe`` keeps one child process (this file run as a script, ``python -P``, so that it imports
nothing but the standard library and ucxx) with its own UCX worker, configured like the daemon's
(the same ``UCX_*`` options, the operator's environment winning). For each worker address it is
given, the child makes an endpoint to it, lets UCX progress for ``SETTLE_S``, aborts the endpoint
and answers one line. The parent (``UcxProbe.probe``) reads the answer:

- ``REACHED``: UCX made the endpoint; the daemon may make its own.
- ``UNREACHABLE``: UCX refused it with an error (no common transport, connection refused, an
  invalid address); the daemon would get the same error.
- ``CRASHED``: the child died (a UCX assertion aborts it); a new child is started for the next
  address.
- ``TIMED_OUT``: no answer within the deadline; the child is killed and replaced.

Protocol, on the child's stdin and stdout: the parent writes a 4-byte little-endian length and
the address; the child answers ``READY`` once, when its worker exists, then one line per address:
``REACHED <ms>`` or ``UNREACHABLE <error>``. The child exits at end of input (so it goes with the
daemon, even a killed one).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal
import struct
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SETTLE_S = 0.05  # how long the child lets UCX progress an endpoint before it answers
START_TIMEOUT_S = 60.0  # a child's start: Python, ucxx and a UCX worker (about a second on 2 cores)
STDERR_LINES = 20  # of the child's stderr, kept to say why it died
KILLED_S = 10.0  # a killed child's standard error reaches its end (the child died) within this
EXIT_STATUS_S = 1.0  # then asyncio reports the child's exit within this, or ``close`` stops waiting for it
_LENGTH = struct.Struct("<I")


class ProbeOutcome(enum.Enum):
    REACHED = "reached"
    UNREACHABLE = "unreachable"
    CRASHED = "crashed"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """One address's probe: the outcome, what the child said or how it died, and the seconds it took."""

    outcome: ProbeOutcome
    detail: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.outcome is ProbeOutcome.REACHED


def child_environment(options: Mapping[str, str]) -> dict[str, str]:
    """This process's environment plus ``UCX_<KEY>=value`` for each option the environment does not
    set itself: the child's UCX then runs as ``ucxx.init(options, env_takes_precedence=True)`` does
    here, except that it sees no GPU (``CUDA_VISIBLE_DEVICES`` empty): UCX's GPU transports would
    make it a CUDA context, about 500 MiB of GPU memory on an H200. It still unpacks the GPU
    transports' entries of an address (UCX unpacks every entry); only their endpoint setup is the
    daemon's alone."""
    env = dict(os.environ)
    for key, value in options.items():
        env.setdefault(f"UCX_{key}", value)
    env.setdefault("UCX_MEMTYPE_CACHE", "n")
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


class UcxProbe:
    """The parent's handle on the probe child. Not thread-safe: one event loop; probes run one at a time.

    ``start()`` launches the child in the background (idempotent); ``probe(address, timeout_s)``
    waits for it and asks; ``close()`` ends it (idempotent). A child that crashed or timed out is
    replaced at the next ``probe``."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self._env = child_environment(options)
        self._proc: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Task | None = None
        self._stderr: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._tail: deque[bytes] = deque(maxlen=STDERR_LINES)
        self.starts = 0  # children started, for tests and logs

    def start(self) -> None:
        if self._ready is None:
            self._ready = asyncio.ensure_future(self._spawn())

    async def ready(self) -> None:
        """Start the child (if it is not started) and wait until it is ready to answer, within its start's own
        deadline (``START_TIMEOUT_S``), so that the first ``probe``'s deadline is spent on the question alone.
        RuntimeError when the child cannot start (a later ``probe`` starts another)."""
        self.start()
        try:
            await asyncio.shield(self._ready)
        except Exception:
            self._ready = None
            raise

    async def _spawn(self) -> asyncio.subprocess.Process:
        self.starts += 1
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-P", str(Path(__file__).resolve()), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=self._env)
        self._tail.clear()
        self._stderr = asyncio.ensure_future(_keep_tail(proc.stderr, self._tail))
        try:
            while True:  # UCX may print its own lines first
                line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
                if not line:
                    raise RuntimeError(f"the UCX probe process exited with status {await proc.wait()} before it was ready")
                if line.strip() == b"READY":
                    self._proc = proc
                    return proc
        except BaseException:
            _kill(proc)
            raise

    async def probe(self, address: bytes, timeout_s: float) -> ProbeResult:
        """Make (and abort) an endpoint to ``address`` in the child; ``timeout_s`` bounds the wait,
        a child's start included. Never raises for what the address does to UCX; RuntimeError when
        no child can be started at all."""
        started = time.perf_counter()
        async with self._lock:
            self.start()
            try:
                proc = await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)
            except asyncio.TimeoutError:
                return ProbeResult(outcome=ProbeOutcome.TIMED_OUT, detail="the probe process was not ready in time",
                                   seconds=time.perf_counter() - started)
            except Exception:
                self._ready = None
                raise
            left = max(timeout_s - (time.perf_counter() - started), 0.1)
            try:
                proc.stdin.write(_LENGTH.pack(len(address)) + address)
                await proc.stdin.drain()
                line = await asyncio.wait_for(_answer(proc), left)
            except asyncio.TimeoutError:
                self._discard(proc)
                return ProbeResult(outcome=ProbeOutcome.TIMED_OUT, detail=f"no answer within {left:.1f} s",
                                   seconds=time.perf_counter() - started)
            except (ConnectionError, BrokenPipeError):
                line = b""
            except BaseException:  # cancelled mid-question: its answer would be taken for the next one's
                self._discard(proc)
                raise
            seconds = time.perf_counter() - started
            if not line:
                code = await proc.wait()
                if self._stderr is not None:
                    await asyncio.wait([self._stderr], timeout=1.0)
                self._discard(proc)
                how = f"killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
                said = _last_words(self._tail)
                return ProbeResult(outcome=ProbeOutcome.CRASHED, detail=f"the UCX probe process {how}"
                                   + (f" ({said})" if said else ""), seconds=seconds)
            word, _, rest = line.decode(errors="replace").strip().partition(" ")
            if word == "REACHED":
                return ProbeResult(outcome=ProbeOutcome.REACHED, detail=rest, seconds=seconds)
            return ProbeResult(outcome=ProbeOutcome.UNREACHABLE, detail=rest, seconds=seconds)

    def _discard(self, proc: asyncio.subprocess.Process) -> None:
        _kill(proc)
        if self._proc is proc:
            self._proc, self._ready = None, None

    def kill(self) -> None:
        """End the child now, without waiting for it (idempotent)."""
        ready, self._ready, proc, self._proc = self._ready, None, self._proc, None
        if ready is not None and not ready.done():
            ready.cancel()
        if proc is not None:
            _kill(proc)

    async def close(self) -> None:
        """End the child (SIGKILL) and wait until it is gone (idempotent): until its standard error ended (it
        died), within ``KILLED_S``, then for asyncio to report its exit, within ``EXIT_STATUS_S``. In a vLLM
        TP worker rank that report can fail to come at all (the child dead, its three pipes closed, and no
        exit status 5.5 s later), and a wait without a deadline held the rank past vLLM's 5 s shutdown grace
        until vLLM killed it."""
        proc, ready, stderr = self._proc, self._ready, self._stderr
        self.kill()
        if ready is not None:
            await asyncio.gather(ready, return_exceptions=True)
        if proc is None:
            return
        if stderr is not None:
            await asyncio.wait([stderr], timeout=KILLED_S)
        exited = asyncio.ensure_future(proc.wait())
        await asyncio.wait([exited], timeout=EXIT_STATUS_S)
        if not exited.done():
            exited.cancel()
            logger.warning("the UCX probe process %d was killed and its exit was not reported within %.1f s (its "
                           "standard error %s); not waiting for it", proc.pid, EXIT_STATUS_S,
                           "ended" if stderr is None or stderr.done() else f"still open after {KILLED_S} s")


async def _answer(proc: asyncio.subprocess.Process) -> bytes:
    """The child's next answer line (UCX's own log lines skipped); b"" when it died."""
    while True:
        line = await proc.stdout.readline()
        if not line or line.startswith((b"REACHED", b"UNREACHABLE")):
            return line


async def _keep_tail(stream: asyncio.StreamReader, tail: deque[bytes]) -> None:
    """Read the child's stderr until it closes, keeping its last lines (what UCX said before dying)."""
    while line := await stream.readline():
        tail.append(line)


def _last_words(tail: deque[bytes]) -> str:
    """The line of the child's stderr that says why it died: UCX's assertion, else its last line."""
    lines = [line.decode(errors="replace").strip() for line in tail if line.strip()]
    said = next((line for line in reversed(lines) if "Assertion" in line or "ERROR" in line), lines[-1] if lines else "")
    return said[-300:]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def main() -> int:
    """The child: a UCX worker, then one endpoint per address read from stdin (see the module docstring)."""
    import ucxx

    ucxx.init()
    out = sys.stdout
    out.write("READY\n")
    out.flush()
    stdin = sys.stdin.buffer

    async def reach(address: bytes) -> str:
        began = time.perf_counter()
        try:
            ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(address),
                                                                endpoint_error_handling=False)
        except Exception as exc:
            return f"UNREACHABLE {type(exc).__name__}: {exc}".replace("\n", " ")
        await asyncio.sleep(SETTLE_S)
        ep.abort()
        return f"REACHED {(time.perf_counter() - began) * 1000:.1f} ms"

    async def serve() -> None:
        while True:
            head = stdin.read(_LENGTH.size)
            if len(head) < _LENGTH.size:
                return
            (n,) = _LENGTH.unpack(head)
            address = stdin.read(n)
            if len(address) < n:
                return
            out.write(await reach(address) + "\n")
            out.flush()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    code = main()
    os._exit(code)  # skip interpreter teardown of the UCX worker
