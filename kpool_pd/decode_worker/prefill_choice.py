"""Which healthy prefill node a request goes to: the least loaded one (the default), or round robin.

A decode node learns each prefill node's load from the answers to its health checks
(``kpool_pd.runtime.load_report``: queued prompt tokens, free blocks, steps running), one every health
interval, and adds what it has picked since: a pick counts its prompt's tokens and blocks on the node
at once, so a burst of requests spreads over the nodes instead of herding onto the one that looked
idlest at the last check. A report covers the picks made before its check was sent (they are either
in its queue or done), so those are dropped when it arrives.

The least loaded node is the one with room for the prompt's blocks (by its report less the blocks this
node's picks took since), then the fewest queued prompt tokens, then the fewest steps running; nodes
equal on all three are taken in turn. A node that reports no load (an older version) counts only this
node's own picks since its last check.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Sequence

from kpool_pd.runtime.load_report import NodeLoad


class PrefillPolicy(enum.Enum):
    """How a decode node picks among its healthy prefill nodes (``--prefill-policy``)."""

    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"

    @classmethod
    def parse(cls, text: object) -> PrefillPolicy:
        """``least-loaded`` or ``round-robin``; ValueError naming both otherwise."""
        try:
            return cls(str(text).strip().lower())
        except ValueError:
            raise ValueError(f"expected one of {[p.value for p in cls]}, got {text!r}") from None


class LoadView:
    """What this decode node knows of one prefill node's load: its last report (None: none or not
    reported) and the picks made since that report's check was sent."""

    __slots__ = ("report", "_picks")

    def __init__(self) -> None:
        self.report: NodeLoad | None = None
        self._picks: collections.deque[tuple[int, int]] = collections.deque()  # (pick number, prompt tokens)

    def reported(self, report: NodeLoad | None, covers: int) -> None:
        """A check's answer: ``report`` (None when the node sent none), which covers the picks numbered up
        to ``covers`` (the picks made before the check was sent)."""
        self.report = report
        while self._picks and self._picks[0][0] <= covers:
            self._picks.popleft()

    def forget(self) -> None:
        """The node is unusable: what was known of it no longer holds (a restart empties its queue)."""
        self.report = None
        self._picks.clear()

    def picked(self, number: int, tokens: int) -> None:
        self._picks.append((number, tokens))

    @property
    def queued_tokens(self) -> int:
        """Reported queued prompt tokens plus this node's picks since."""
        own = sum(tokens for _, tokens in self._picks)
        return own + (self.report.queued_prompt_tokens if self.report is not None else 0)

    def lacks_room(self, tokens: int) -> bool:
        """Whether the node's free blocks, less those of this node's picks since its report, are fewer than
        a prompt of ``tokens`` takes (False when it reports nothing)."""
        report = self.report
        if report is None:
            return False
        taken = sum(report.blocks_for(t) for _, t in self._picks)
        return report.free_blocks - taken < report.blocks_for(tokens)

    @property
    def steps(self) -> int:
        return self.report.steps_in_flight if self.report is not None else 0

    def describe(self) -> dict[str, int | None]:
        """For logs and tests: queued tokens as estimated, and the report's fields."""
        report = self.report
        return {"queued_tokens": self.queued_tokens, "own_picks": len(self._picks),
                "free_blocks": None if report is None else report.free_blocks,
                "steps_in_flight": None if report is None else report.steps_in_flight}


class PrefillChooser:
    """Picks an index into a list of candidate nodes' ``LoadView`` and counts the pick on it. One event
    loop; ``picks`` numbers the picks made so far (what a check records as covered when it is sent)."""

    def __init__(self, policy: PrefillPolicy) -> None:
        if not isinstance(policy, PrefillPolicy):
            raise TypeError(f"policy must be a PrefillPolicy, got {policy!r}")
        self.policy = policy
        self.picks = 0
        self._turn = 0

    def choose(self, views: Sequence[LoadView], tokens: int) -> int:
        """The index of the node a prompt of ``tokens`` tokens goes to (``views`` not empty); the pick is
        counted on that node's view."""
        if not views:
            raise ValueError("no prefill node to choose from")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"prompt tokens must be an integer >= 0, got {tokens!r}")
        n, start = len(views), self._turn % len(views)
        self._turn += 1
        if self.policy is PrefillPolicy.ROUND_ROBIN:
            chosen = start
        else:  # in turn from ``start``, so that min() takes nodes equal on load in turn
            order = [(start + k) % n for k in range(n)]
            chosen = min(order, key=lambda i: (views[i].lacks_room(tokens), views[i].queued_tokens, views[i].steps))
        self.picks += 1
        views[chosen].picked(self.picks, tokens)
        return chosen
