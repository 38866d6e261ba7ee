"""Grants held by the prefill node under lease: renewed by Heartbeat, freed by Release or expiry."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kpool_pd.connector.shared.plan import RingRange

if TYPE_CHECKING:
    from kpool_pd.connector.prefill.engine import PrefillProgress


@dataclass(kw_only=True, eq=False)
class Grant:
    """A prefilled request's blocks held for ``engine_id``, the decode engine that asked for them:
    only it may pull, release or renew them.

    A pipelined grant is made before its prompt is computed: ``prefill`` is the engine's task until it
    ends (``progress.prefilled`` says how far it got), ``first_token`` and ``prefill_ms`` are set then, and
    ``failure`` says why it failed, if it did. ``piece_blocks`` splits the transfer plan (0: not split)."""

    grant_id: str
    request_id: str
    engine_id: str
    block_ids: tuple[int, ...]
    ring_id: int
    prompt_len: int
    live: RingRange
    first_token: int
    expires_at: float
    progress: "PrefillProgress"  # the engine's allocation (released when the grant is freed) and how far it is written
    pulls_in_flight: int = 0
    release_requested: bool = False
    prefill: asyncio.Task | None = None  # a pipelined grant's computation (its result: the output and its ms)
    piece_blocks: int = 0
    prefill_ms: float = 0.0
    computed_at: float = 0.0  # a grant made after its prompt: when the computation ended (perf_counter)
    failure: str = ""

    # A decode-context-parallel instance: its ranks' engine ids (rank 0's is ``engine_id``) and its
    # interleave; each rank pulls and releases its own share, and the grant is released once all did.
    dcp_engine_ids: tuple[str, ...] = ()
    dcp_interleave: int = 0
    ranks_released: set[int] = field(default_factory=set)

    @property
    def computing(self) -> bool:
        """The prompt is still being computed (a pipelined grant)."""
        return self.prefill is not None and not self.prefill.done()

    def owned_by(self, engine_id: str) -> bool:
        """Whether ``engine_id`` may renew the grant: the engine that asked, or one of its DCP ranks."""
        return engine_id == self.engine_id or engine_id in self.dcp_engine_ids

    def release_rank(self, rank: int) -> None:
        """Rank ``rank``'s share is released; the whole grant once every rank's is."""
        self.ranks_released.add(rank)
        if len(self.ranks_released) >= len(self.dcp_engine_ids):
            self.release_requested = True


class LeaseTable:
    """Grants by id. A grant whose lease ran out is gone for every lookup; it is handed to the
    reaper by ``take_expired`` once no pull reads its blocks (a pull's own deadline bounds that)."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self._clock = clock
        self._grants: dict[str, Grant] = {}

    def __len__(self) -> int:
        return len(self._grants)

    def __contains__(self, grant_id: str) -> bool:
        """Whether a grant of this id is held (live, or ended and not reaped yet)."""
        return grant_id in self._grants

    def add(self, grant: Grant) -> None:
        if grant.grant_id in self._grants:
            raise ValueError(f"grant {grant.grant_id} exists")
        self._grants[grant.grant_id] = grant

    def expiry(self) -> float:
        return self._clock() + self.lease_s

    def live(self, grant_id: str) -> Grant | None:
        """The grant if it is held and its lease has not run out."""
        grant = self._grants.get(grant_id)
        if grant is None or grant.release_requested or grant.expires_at <= self._clock():
            return None
        return grant

    def renew(self, grant_id: str) -> bool:
        grant = self.live(grant_id)
        if grant is None:
            return False
        grant.expires_at = self.expiry()
        return True

    def pop(self, grant_id: str) -> Grant | None:
        return self._grants.pop(grant_id, None)

    def held_for(self, request_id: str, engine_id: str) -> list[Grant]:
        """``engine_id``'s unreleased grants for ``request_id`` (request ids are a decode engine's own:
        another engine's request of the same id is no conflict, and no answer says it exists)."""
        return [g for g in self._grants.values()
                if g.request_id == request_id and g.engine_id == engine_id and not g.release_requested]

    def take_expired(self) -> list[Grant]:
        """Remove and return the grants that are expired (or released) and no longer read."""
        now = self._clock()
        done = [g for g in self._grants.values()
                if (g.expires_at <= now or g.release_requested) and g.pulls_in_flight == 0]
        for g in done:
            del self._grants[g.grant_id]
        return done

    def pop_all(self) -> list[Grant]:
        """Remove and return every grant (a node that stops frees them all)."""
        grants = list(self._grants.values())
        self._grants.clear()
        return grants
