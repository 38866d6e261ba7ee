"""Starting daemons as local subprocesses: ``kpool-pd up`` and the end-to-end tests use it.

Each daemon gets ``--port 0`` and a ready file; the launcher waits (with a deadline) until the
file appears, which the daemon writes only after its warm-up, and reads the bound ports from it.
Logs go to a file per daemon, whose tail is shown when a daemon fails to start.

A daemon runs in its own session (a terminal's Ctrl-C reaches the launcher, which stops its
daemons in order), and on Linux it is asked to drain (SIGTERM) when the thread that started it
dies, however it dies (SIGKILL included): a launcher never leaves daemons behind. Start daemons
from a thread that outlives them (the main thread).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from kpool_pd.runtime.process import parent_death_env

logger = logging.getLogger(__name__)

class DaemonError(RuntimeError):
    pass


class Daemon:
    """One daemon subprocess (``python -m <module> ...``). ``stop()`` is idempotent: SIGTERM, then
    SIGKILL after ``grace_s``; a context manager."""

    def __init__(self, module: str, args: Sequence[str], workdir: Path, name: str, *,
                 env: dict[str, str] | None = None, netns: str | None = None) -> None:
        self.name = name
        self.ready_file = workdir / f"{name}.ready.json"
        self.log_path = workdir / f"{name}.log"
        self.ready_file.unlink(missing_ok=True)
        command = [sys.executable, "-m", module, *args, "--ready-file", str(self.ready_file)]
        if netns:
            command = ["ip", "netns", "exec", netns, *command]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **parent_death_env(), **(env or {})},
                                     start_new_session=True)
        self.info: dict = {}

    @property
    def port(self) -> int:
        return int(self.info["grpc_port"])

    @property
    def metrics_port(self) -> int:
        return int(self.info["metrics_port"])

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                return self.info
            if self.proc.poll() is not None:
                raise DaemonError(f"{self.name} exited with status {self.proc.returncode} before it was ready:\n"
                                  f"{self.log_tail()}")
            time.sleep(0.05)
        raise DaemonError(f"{self.name} was not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL now (a crash)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM (the daemon drains), SIGKILL after ``grace_s``; its exit status (idempotent)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s of SIGTERM; killing it", self.name, grace_s)
                self.proc.kill()
                self.proc.wait(10)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_prefill(workdir: Path, model: Sequence[str], *, name: str = "prefill", host: str = "127.0.0.1",
                  transports: str = "auto", extra: Sequence[str] = (), netns: str | None = None,
                  env: dict[str, str] | None = None) -> Daemon:
    """A prefill daemon on ``host`` (any free ports) offering ``transports``; ``model`` is its model
    flags (``runtime.model_flags``), ``extra`` any other flags, ``env`` extra environment variables
    (secrets go there, ``KPOOLPD_PEER_TOKEN``: a command line is readable by every user)."""
    return Daemon("kpool_pd.prefill_worker", ["--host", host, "--port", "0", "--metrics-host", host, "--metrics-port", "0",
                                     "--transports", transports, *model, *extra], workdir, name, netns=netns, env=env)


def start_decode(workdir: Path, model: Sequence[str], prefill: Sequence[str], *, name: str = "decode",
                 host: str = "127.0.0.1", transport: str = "auto", extra: Sequence[str] = (),
                 netns: str | None = None, env: dict[str, str] | None = None,
                 module: str = "kpool_pd.decode_worker") -> Daemon:
    """A decode daemon on ``host`` (any free ports) pulling from the ``prefill`` addresses over
    ``transport`` (also what it offers); ``model``, ``extra`` and ``env`` as for ``start_prefill``
    (``KPOOLPD_TOKEN``, ``KPOOLPD_PEER_TOKEN``); ``module`` the daemon's module (a test's variant)."""
    return Daemon(module, ["--host", host, "--port", "0", "--metrics-host", host, "--metrics-port", "0",
                                    "--prefill", ",".join(prefill), "--transport", transport,
                                    "--transports", transport, *model, *extra], workdir, name, netns=netns, env=env)
