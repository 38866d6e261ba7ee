"""The instances a router sends to, and the choice among them: fewest outstanding requests first, an
instance that failed lately or that its health probe found down last, the one picked longest ago on a tie.

An instance is ``UP``, ``FAILED`` (a request failed on it: a connect failure, a timeout, a 5xx, an answer
no PD request can use; for ``cooldown_s``, or until a request or probe succeeds there) or ``DOWN`` (its
``GET /health`` probe failed; until a probe succeeds). Each remembers its last failure, reason and time,
for ``/health``."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class InstanceState(enum.Enum):
    UP = "up"
    FAILED = "failed"  # a request failed there lately (cooling down)
    DOWN = "down"      # its health probe failed


@dataclass(frozen=True)
class Failure:
    reason: str
    at: float  # the pool's clock (monotonic)


class Instance:
    """One ``vllm serve`` instance: its base URL, the requests it has now, its state and last failure."""

    __slots__ = ("url", "role", "outstanding", "state", "last_failure", "picked")

    def __init__(self, url: str, role: Role) -> None:
        self.url, self.role = url, role
        self.outstanding = 0
        self.state = InstanceState.UP
        self.last_failure: Failure | None = None
        self.picked = 0  # the pick sequence number of its last pick (0: never)

    def state_at(self, now: float, cooldown_s: float) -> InstanceState:
        """Its state at ``now``: FAILED lapses to UP once ``cooldown_s`` passed since the failure."""
        if self.state is InstanceState.FAILED and now - self.last_failure.at >= cooldown_s:
            return InstanceState.UP
        return self.state

    def __repr__(self) -> str:
        return f"Instance({self.role.value} {self.url}, {self.state.value}, outstanding={self.outstanding})"


class InstancePool:
    """The instances of one role. Not thread-safe: the router's one event loop uses it."""

    def __init__(self, role: Role, urls: tuple[str, ...], *, cooldown_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not urls:
            raise ValueError(f"no {role.value} instances")
        self.role = role
        self.instances = tuple(Instance(url, role) for url in urls)
        self._cooldown_s, self._clock = cooldown_s, clock
        self._picks = itertools.count(1)

    def state(self, instance: Instance) -> InstanceState:
        return instance.state_at(self._clock(), self._cooldown_s)

    def cooling(self, instance: Instance) -> bool:
        """Not UP now: failed lately or down."""
        return self.state(instance) is not InstanceState.UP

    def choose(self, skip: set[str] = frozenset()) -> Instance | None:
        """The instance to send to next, not one of ``skip`` (URLs); None when every one is skipped. One
        that is not UP is chosen only when no UP one is left (its state may be stale)."""
        candidates = [i for i in self.instances if i.url not in skip]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda i: (self.cooling(i), i.outstanding, i.picked))
        chosen.picked = next(self._picks)
        return chosen

    @contextmanager
    def outstanding(self, instance: Instance) -> Iterator[Instance]:
        """Counts a request on ``instance`` while the block runs."""
        instance.outstanding += 1
        try:
            yield instance
        finally:
            instance.outstanding -= 1

    def failed(self, instance: Instance, reason: str) -> None:
        """A request failed there: FAILED unless its probe already found it DOWN."""
        instance.last_failure = Failure(reason, self._clock())
        if instance.state is not InstanceState.DOWN:
            instance.state = InstanceState.FAILED

    def down(self, instance: Instance, reason: str) -> None:
        """Its health probe failed."""
        instance.last_failure = Failure(reason, self._clock())
        instance.state = InstanceState.DOWN

    def succeeded(self, instance: Instance) -> None:
        """A request or a probe succeeded there: UP (its last failure stays on record)."""
        instance.state = InstanceState.UP

    def usable(self) -> int:
        """Instances UP now."""
        return sum(not self.cooling(i) for i in self.instances)

    def report(self) -> list[dict]:
        """Each instance for ``/health``: role, URL, state, outstanding requests, last failure (reason and
        seconds ago) or None."""
        now = self._clock()
        return [{"role": self.role.value, "url": i.url, "state": self.state(i).value, "outstanding": i.outstanding,
                 "last_failure": None if i.last_failure is None else
                 {"reason": i.last_failure.reason, "seconds_ago": round(now - i.last_failure.at, 3)}}
                for i in self.instances]
