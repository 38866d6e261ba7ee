"""A lock one test holds across every copy of the suite running on this machine, for what cannot be shared: the
fixed ports of a README's commands run as written. Another copy's test waits for it (an exclusive ``flock`` on a
file of the machine's temporary folder, let go when its holder ends, however it ends)."""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.support.polling import wait_for


def try_flock(handle) -> bool:
    """An exclusive ``flock`` on ``handle``'s file, taken now or not at all (no wait)."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def machine_lock(name: str, within_s: float) -> Iterator[None]:
    """Hold the machine-wide lock ``name`` for the block; AssertionError when another holder kept it past
    ``within_s`` (on an idle machine; ``wait_for`` stretches it for the load)."""
    path = Path(tempfile.gettempdir()) / f"kpool-pd-tests-{name}.lock"
    with open(path, "a+") as handle:
        assert wait_for(lambda: try_flock(handle), within_s, period_s=0.5), \
            f"another copy of the suite held the machine's lock {path} past the deadline"
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
