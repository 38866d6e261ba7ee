"""The decode daemon for the soak test (``python -m tests.support.soak_decode <decode flags>``): the real
daemon, except that a request whose id asks for it (``@decoding``) is held in the running batch
once the decode loop has stepped it once, until its client's cancel has come (at most ``HOLD_S``
per step), so that the cancel lands while it decodes. Without the hold a small request can finish
all its tokens before a cancel sent after its second tokens reaches the node (the cancel then
counts nothing), which a loaded machine makes likely.

Nothing else changes: the held request is freed by the decode loop between steps, as a real
cancel in the running batch is.
"""

from __future__ import annotations

import os
import sys
import time

from kpool_pd.decode_worker.daemon import main
from kpool_pd.decode_worker.scheduler import DecodeScheduler

HOLD_S = float(os.environ.get("KPOOLPD_SOAK_HOLD_S", "2.0"))


def install_hold() -> None:
    """Patch the decode loop's step (before the daemon builds its scheduler)."""
    real_step = DecodeScheduler._step

    def step(self, jobs):
        held = [j for j in jobs if "@decoding" in j.request_id and j.seq.steps >= 1]
        for job in held:  # a worker thread: the handler sets ``cancelled`` on the event loop
            until = time.monotonic() + HOLD_S  # the daemon's hold, not a test's wait: not stretched
            while not job.cancelled and time.monotonic() < until:
                time.sleep(0.01)
        return real_step(self, jobs)

    DecodeScheduler._step = step


if __name__ == "__main__":
    install_hold()
    sys.exit(main())
