"""The instances a router sends to, and the choice among them: fewest outstanding requests first, an
instance that failed lately last, the one picked longest ago on a tie."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Instance:
    """One ``vllm serve`` instance: its base URL, the requests it has now, when it last failed."""

    __slots__ = ("url", "role", "outstanding", "failed_at", "picked")

    def __init__(self, url: str, role: Role) -> None:
        self.url, self.role = url, role
        self.outstanding = 0
        self.failed_at: float | None = None
        self.picked = 0  # the pick sequence number of its last pick (0: never)

    def cooling(self, now: float, cooldown_s: float) -> bool:
        return self.failed_at is not None and now - self.failed_at < cooldown_s

    def __repr__(self) -> str:
        return f"Instance({self.role.value} {self.url}, outstanding={self.outstanding})"


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

    def cooling(self, instance: Instance) -> bool:
        return instance.cooling(self._clock(), self._cooldown_s)

    def choose(self, skip: set[str] = frozenset()) -> Instance | None:
        """The instance to send to next, not one of ``skip`` (URLs); None when every one is skipped."""
        now = self._clock()
        candidates = [i for i in self.instances if i.url not in skip]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda i: (i.cooling(now, self._cooldown_s), i.outstanding, i.picked))
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

    def failed(self, instance: Instance) -> None:
        instance.failed_at = self._clock()

    def succeeded(self, instance: Instance) -> None:
        instance.failed_at = None

    def usable(self) -> int:
        """Instances not cooling down after a failure."""
        return sum(not self.cooling(i) for i in self.instances)
