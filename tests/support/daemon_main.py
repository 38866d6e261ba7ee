"""A daemon's ``main(argv)`` in a child process forked with torch imported (``kpool_pd.runtime.launch``), for
the tests of what a daemon does with its settings before it serves: the child takes the environment it is
given, writes its stdout and stderr to files of its own, and exits with ``main``'s status, as
``python -m kpool_pd.<role>_worker`` would, without a fresh interpreter's imports each time (about two seconds
of the 2-core CI machine). A few cases a test runs as the real ``python -m`` command keep the entry itself
covered.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kpool_pd.runtime.launch import start_child
from tests.support.deadlines import patient


@dataclass(frozen=True)
class Exited:
    status: int | None  # None: still running at the deadline (then killed)
    stdout: str
    stderr: str


def _main_in_child(module: str, argv: list[str], environ: dict[str, str], out: str, err: str) -> None:
    """The child: ``environ`` as its whole environment, fds 1 and 2 to ``out`` and ``err``, then the daemon."""
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    os.environ.clear()
    os.environ.update(environ)
    try:
        status = importlib.import_module(f"{module}.daemon").main(argv)
    except SystemExit as exc:  # argparse's exits
        status = exc.code if isinstance(exc.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_daemon_main(module: str, argv: Sequence[str], env: Mapping[str, str], folder: Path,
                    timeout_s: float = 30) -> Exited:
    """``module``'s ``main(argv)`` (``kpool_pd.prefill_worker`` or ``kpool_pd.decode_worker``) in a forked child
    with exactly ``env`` as its environment; its status and output once it exited (``timeout_s`` on an idle
    machine: stretched by ``patient``; a child still running then is killed and its status is None)."""
    out, err = folder / "daemon.stdout", folder / "daemon.stderr"
    child = start_child(_main_in_child, module, list(argv), dict(env), str(out), str(err))
    child.join(patient(timeout_s))
    status = child.exitcode
    if status is None:
        child.kill()
        child.join()
    return Exited(status, out.read_text(errors="replace"), err.read_text(errors="replace"))
