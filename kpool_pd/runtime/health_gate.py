"""What grpc.health.v1 reports for a daemon: SERVING only while the runtime says the daemon is up
and its node says it can serve.

The runtime owns the gate (``NodeContext.health``): ``open(server)`` once the server is bound
(the warm-up is done), ``drain()`` at SIGTERM, after which nothing turns it SERVING again. A
node that cannot always serve when it is up reports that with ``set_able(False, reason)`` and
``set_able(True)`` (the decode node: no prefill node usable, or no room for a request). The
ready file does not wait for the node: a deployment may start its daemons in any order, and
health says when the node can take requests.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

logger = logging.getLogger(__name__)


class HealthReporter(Protocol):
    """What the gate drives: ``runtime.GrpcServer``."""

    async def set_serving(self, serving: bool) -> None: ...


class HealthGate:
    """SERVING = opened and not draining and able and not held. One event loop; ``set_able`` may
    be called from plain (non-async) code on that loop, before or after ``open``."""

    def __init__(self) -> None:
        self._server: HealthReporter | None = None
        self._draining = False
        self._able = True
        self.reason = ""  # why the node cannot serve, while it cannot
        self._held: tuple[str, ...] = ()  # why this process can never serve (start-up checks)
        self._lock = asyncio.Lock()
        self._pending: set[asyncio.Task] = set()

    @property
    def serving(self) -> bool:
        return self._server is not None and not self._draining and self._able and not self._held

    @property
    def held(self) -> tuple[str, ...]:
        """The reasons given to ``hold``, in order; empty when none."""
        return self._held

    def hold(self, reason: str) -> None:
        """This process can never serve (``reason`` in words, logged as an error): NOT_SERVING from
        now on, whatever ``set_able`` says. Call it before ``open``, so that SERVING is never reported."""
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"hold needs a reason in words, got {reason!r}")
        if self._server is not None:
            raise RuntimeError("hold before open: a held node must never report SERVING")
        self._held = (*self._held, reason)
        logger.error("this node will not turn ready: %s", reason)

    @property
    def able(self) -> bool:
        return self._able

    async def open(self, server: HealthReporter) -> None:
        """The daemon is up: report through ``server`` from now on (SERVING if the node is able)."""
        self._server = server
        await self._apply()

    async def drain(self) -> None:
        """The daemon drains: NOT_SERVING from now on, whatever the node says."""
        self._draining = True
        await self._apply()

    def set_able(self, able: bool, reason: str = "") -> None:
        """The node can (True) or cannot (False, ``reason`` in words) serve requests now;
        idempotent. Applied in a task when the gate is open (health changes a moment later)."""
        if not isinstance(able, bool):
            raise TypeError(f"able must be a bool, got {able!r}")
        changed = able != self._able
        self._able, self.reason = able, "" if able else reason
        if changed:
            if able and self._held:
                logger.info("this node could serve again, but it will not turn ready: %s", "; ".join(self._held))
            elif able:
                logger.info("this node can serve again")
            else:
                logger.warning("this node cannot serve: %s", reason)
        if changed and self._server is not None:
            task = asyncio.get_running_loop().create_task(self._apply())
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _apply(self) -> None:
        """Report the state as it is when the report is made (so the last change always wins)."""
        async with self._lock:
            if self._server is not None:
                await self._server.set_serving(self.serving)
