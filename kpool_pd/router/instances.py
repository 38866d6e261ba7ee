"""The instances a router sends to, and the choice among them, by load and by prefix.

Load: a prefill instance's is its outstanding prompt tokens (then requests), a decode instance's its
outstanding requests (then tokens: prompt and ``max_tokens``), as sent through this router. The least
loaded instance is chosen; an instance that failed lately or that its health probe found down last, the one
picked longest ago on a tie. Prefix: with a ``PrefixTable``, a prompt whose longest known block-aligned
prefix was last routed to an instance goes there again (its prefix cache holds it), unless that instance's
outstanding tokens exceed the least loaded one's by more than ``affinity_margin_tokens``, or it is not UP;
either way the prompt's prefixes are recorded as the chosen instance's.

The set of instances may change while the router runs (``set_urls``: addresses found through DNS); an
instance that leaves keeps serving the requests it has, and is no longer chosen.

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

from kpool_pd.router.prefix import PrefixTable, PromptShape


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
    """One ``vllm serve`` instance: its base URL, the requests and tokens it has now through this router, its
    state and last failure, and counts of its picks (by prefix affinity among them) and failures."""

    __slots__ = ("url", "role", "outstanding", "outstanding_tokens", "state", "last_failure", "picked", "picks",
                 "affinity_picks", "failures")

    def __init__(self, url: str, role: Role) -> None:
        self.url, self.role = url, role
        self.outstanding = 0
        self.outstanding_tokens = 0
        self.picks = self.affinity_picks = self.failures = 0
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
    """The instances of one role (``urls``; none yet when they are to be found through DNS). ``prefix``:
    the table of prefix affinity (None: by load alone). Not thread-safe: the router's one event loop uses it."""

    def __init__(self, role: Role, urls: tuple[str, ...], *, cooldown_s: float,
                 clock: Callable[[], float] = time.monotonic, prefix: PrefixTable | None = None,
                 affinity_margin_tokens: int = 0) -> None:
        if affinity_margin_tokens < 0:
            raise ValueError(f"affinity_margin_tokens must be >= 0, got {affinity_margin_tokens}")
        self.role = role
        self._instances: dict[str, Instance] = {url: Instance(url, role) for url in urls}
        self._cooldown_s, self._clock = cooldown_s, clock
        self._picks = itertools.count(1)
        self.prefix, self.affinity_margin_tokens = prefix, affinity_margin_tokens

    @property
    def instances(self) -> tuple[Instance, ...]:
        return tuple(self._instances.values())

    def set_urls(self, urls: list[str]) -> tuple[list[str], list[str]]:
        """The instances are ``urls`` from now on (those already known keep their counts and state); returns
        the URLs added and removed."""
        added = [u for u in urls if u not in self._instances]
        removed = [u for u in self._instances if u not in urls]
        for url in removed:
            del self._instances[url]
        for url in added:
            self._instances[url] = Instance(url, self.role)
        return added, removed

    def _load(self, instance: Instance) -> tuple[int, int]:
        if self.role is Role.PREFILL:
            return instance.outstanding_tokens, instance.outstanding
        return instance.outstanding, instance.outstanding_tokens

    def state(self, instance: Instance) -> InstanceState:
        return instance.state_at(self._clock(), self._cooldown_s)

    def cooling(self, instance: Instance) -> bool:
        """Not UP now: failed lately or down."""
        return self.state(instance) is not InstanceState.UP

    def choose(self, skip: set[str] = frozenset(), shape: PromptShape | None = None) -> Instance | None:
        """The instance to send a request of ``shape`` to next, not one of ``skip`` (URLs); None when every one
        is skipped. One that is not UP is chosen only when no UP one is left (its state may be stale)."""
        candidates = [i for i in self._instances.values() if i.url not in skip]
        if not candidates:
            return None
        chosen = min(candidates, key=lambda i: (self.cooling(i), *self._load(i), i.picked))
        hashes = shape.prefix_hashes if shape is not None and self.prefix is not None else ()
        if hashes:
            url, _ = self.prefix.match(hashes)
            owner = next((i for i in candidates if i.url == url), None)
            if owner is not None and not self.cooling(owner) and \
                    owner.outstanding_tokens <= chosen.outstanding_tokens + self.affinity_margin_tokens:
                chosen = owner
                owner.affinity_picks += 1
            self.prefix.record(hashes, chosen.url)
        chosen.picked = next(self._picks)
        chosen.picks += 1
        return chosen

    @contextmanager
    def outstanding(self, instance: Instance, tokens: int = 0) -> Iterator[Instance]:
        """Counts a request of ``tokens`` tokens on ``instance`` while the block runs."""
        instance.outstanding += 1
        instance.outstanding_tokens += tokens
        try:
            yield instance
        finally:
            instance.outstanding -= 1
            instance.outstanding_tokens -= tokens

    def failed(self, instance: Instance, reason: str) -> None:
        """A request failed there: FAILED unless its probe already found it DOWN."""
        instance.last_failure = Failure(reason, self._clock())
        instance.failures += 1
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
        return sum(not self.cooling(i) for i in self._instances.values())

    def report(self) -> list[dict]:
        """Each instance for ``/health``: role, URL, state, outstanding requests and tokens, picks, last failure
        (reason and seconds ago) or None."""
        now = self._clock()
        return [{"role": self.role.value, "url": i.url, "state": self.state(i).value, "outstanding": i.outstanding,
                 "outstanding_tokens": i.outstanding_tokens, "picks": i.picks, "affinity_picks": i.affinity_picks,
                 "last_failure": None if i.last_failure is None else
                 {"reason": i.last_failure.reason, "seconds_ago": round(now - i.last_failure.at, 3)}}
                for i in self.instances]
