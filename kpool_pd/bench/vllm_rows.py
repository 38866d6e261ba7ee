"""The rows of ``kpool-pd bench vllm`` (``kpool_pd.bench.vllm_pd``): the connectors it runs, its scenarios
(requests sent at once, their prompt lengths), a rep's phases, a row's medians and the table that sets the
rows side by side with their ratios to the fastest of vLLM's own connectors."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kpool_pd.bench import vllm_engines

MIXED_SHORTEST, MIXED_LONGEST = 7, 2000  # the prompt lengths of a concurrent scenario span these


class Connector(Enum):
    KPOOL_UCX = "kpool-ucx"  # each grant pulled when its decode request comes
    KPOOL_UCX_PREFETCH = "kpool-ucx-prefetch"  # the same connector, the proxy naming the consumer (prefetch_by): the
    # producer announces each grant to it and it pulls the grant before its decode request comes
    KPOOL_UCX_PREFETCH_IDLE = "kpool-ucx-prefetch-idle"  # the same, the producer announcing at its first step that
    # computes nothing (``announce`` "idle"): no transfer beside its forward
    KPOOL_GRPC = "kpool-grpc"
    NIXL = "nixl"
    MOONCAKE = "mooncake"
    FLOOR = "floor"  # no connector: one engine, the prompts served from its own prefix cache
    NO_TRANSFER = "no-transfer"  # one engine with vLLM's DecodeBenchConnector: the prompts' KV claimed, none moved


VLLM_CONNECTORS = (Connector.NIXL, Connector.MOONCAKE)  # the connectors each row is compared with


@dataclass(frozen=True)
class Scenario:
    """Requests sent at once: one prompt length each; the consumer makes ``new_tokens`` for each."""

    lengths: tuple[int, ...]
    new_tokens: int

    @property
    def requests(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def prompts(self, rep: int) -> list[list[int]]:
        """Rep ``rep``'s prompts: random tokens, the same for every connector (seeded by the scenario and rep)."""
        rng = random.Random(f"{self.requests}:{self.tokens}:{rep}")
        return [[rng.randrange(3, vllm_engines.TINY_LLAMA["vocab_size"]) for _ in range(n)] for n in self.lengths]


def mixed_lengths(requests: int, shortest: int = MIXED_SHORTEST, longest: int = MIXED_LONGEST) -> tuple[int, ...]:
    """``requests`` prompt lengths spread evenly on a log scale from ``shortest`` to ``longest`` (both
    included), in a fixed shuffled order."""
    if requests == 1:
        return (longest,)
    lengths = [round(shortest * (longest / shortest) ** (i / (requests - 1))) for i in range(requests)]
    random.Random(requests).shuffle(lengths)
    return tuple(lengths)


@dataclass(frozen=True)
class Row:
    connector: str
    tokens: int  # prompt tokens of one rep, every request's together
    reps: int
    prefill_ms: float | None  # median, the producer's generate of one token a request (None: the floor)
    decode_first_token_ms: float  # median, the consumer phase: the pull plus new_tokens a request
    ttft_ms: float | None  # prefill_ms + decode_first_token_ms (TTFT when new_tokens is 1)
    same_tokens: bool | None  # the consumer's tokens equal one engine's, every request of every rep (None: not
    # compared, the no-transfer engine's KV is a constant)
    pulled_tokens: int  # prompt tokens vLLM counted as loaded by the connector (the floor: found in its cache)
    requests: int = 1  # sent at once
    new_tokens: int = 1  # the consumer makes for each request
    consumer_ms_reps: tuple[float, ...] = ()  # each rep's consumer phase, in the order the reps ran
    prefill_ms_reps: tuple[float, ...] = ()  # each rep's prefill phase (none for the floor)
    differing_requests: int = 0  # the most requests of one rep whose tokens differ from one engine's
    first_difference: int = -1  # the earliest new token (0: the first) at which one differs; -1: none does


@dataclass(frozen=True)
class Rep:
    """One rep of a scenario: its phases in seconds, whether every token equalled one engine's, and the
    prompt tokens pulled (or found in the floor engine's cache)."""

    prefill_s: float | None
    consumer_s: float
    same_tokens: bool | None  # None: not compared
    pulled_tokens: int
    differing_requests: int = 0  # requests whose tokens differ from one engine's
    first_difference: int = -1  # the earliest new token at which one differs (-1: none)


def token_mismatch(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(how many requests' tokens in ``got`` differ from ``want``'s, the earliest position at which one differs;
    -1 when none does). A request with fewer or more tokens differs where the shorter one ends.

    # got, want: one token list per request, in the same order -> (requests, position)
    """
    if len(got) != len(want):
        raise ValueError(f"got tokens of {len(got)} requests, want {len(want)}")
    positions = []
    for mine, theirs in zip(got, want):
        mine, theirs = list(mine), list(theirs)
        if mine != theirs:
            positions.append(next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b),
                                  min(len(mine), len(theirs))))
    return len(positions), min(positions, default=-1)


def row_of(connector: Connector, scenario: Scenario, reps: list[Rep]) -> Row:
    """The medians of ``reps`` as a Row."""
    first = statistics.median(r.consumer_s for r in reps)
    prefill = None if reps[0].prefill_s is None else statistics.median(r.prefill_s for r in reps)
    return Row(connector=connector.value, tokens=scenario.tokens, reps=len(reps),
               prefill_ms=None if prefill is None else prefill * 1e3, decode_first_token_ms=first * 1e3,
               ttft_ms=None if prefill is None else (prefill + first) * 1e3,
               same_tokens=None if any(r.same_tokens is None for r in reps) else all(r.same_tokens for r in reps),
               pulled_tokens=sum(r.pulled_tokens for r in reps),
               requests=scenario.requests, new_tokens=scenario.new_tokens,
               consumer_ms_reps=tuple(round(r.consumer_s * 1e3, 1) for r in reps),
               prefill_ms_reps=tuple(round(r.prefill_s * 1e3, 1) for r in reps if r.prefill_s is not None),
               differing_requests=max(r.differing_requests for r in reps),
               first_difference=min((r.first_difference for r in reps if r.first_difference >= 0), default=-1))


def label(scenario: Scenario) -> str:
    if scenario.requests == 1:
        return f"{scenario.tokens} tokens"
    return f"{scenario.requests} requests at once ({scenario.tokens} tokens)"


def _same(row: Row) -> str:
    """yes, or NO with how many requests of a rep differed (at most) and from which new token (0: the first);
    for a row whose tokens are not compared, why."""
    if row.same_tokens is None:
        return "- (KV not the prompt's)"
    if row.same_tokens:
        return "yes"
    if not row.differing_requests:
        return "NO"
    return f"NO ({row.differing_requests} of {row.requests}, from token {row.first_difference})"


def _ratio(value: float | None, best: float | None) -> str:
    return "-" if value is None or not best else f"{value / best:.2f}x"


def table(rows: list[Row]) -> str:
    """The rows side by side, per scenario (requests at once, prompt tokens), each with the ratio of its
    consumer phase and of its prefill + consumer phase to the fastest of vLLM's connectors (NixlConnector,
    MooncakeConnector) in the same scenario, for vLLM's own the fastest other one ("-": none in the run), and
    its consumer phase less the no-transfer engine's in the same scenario (what its transfer added to the
    compute; "-": no such row)."""
    order = {c.value: i for i, c in enumerate(Connector)}
    vllm_names = {c.value for c in VLLM_CONNECTORS}

    def best(row: Row, field: str) -> float | None:
        values = [getattr(r, field) for r in rows if r.connector in vllm_names and r.connector != row.connector
                  and (r.requests, r.tokens, r.new_tokens) == (row.requests, row.tokens, row.new_tokens)
                  and getattr(r, field) is not None]
        return min(values, default=None)

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    def over_no_transfer(row: Row) -> str:
        floor = [r.decode_first_token_ms for r in rows if r.connector == Connector.NO_TRANSFER.value
                 and (r.requests, r.tokens, r.new_tokens) == (row.requests, row.tokens, row.new_tokens)]
        if not floor or row.connector == Connector.NO_TRANSFER.value:
            return "-"
        return f"{row.decode_first_token_ms - floor[0]:+.1f}"

    width = max([len("connector")] + [len(r.connector) for r in rows])
    lines = [f"{'connector':<{width}} {'requests':>8} {'tokens':>6} {'new tok':>7} {'prefill ms':>10} {'consumer ms':>11} "
             f"{'sum ms':>8} {'consumer vs best':>16} {'sum vs best':>11} {'over no-transfer':>16} {'pulled':>7} "
             "same tokens"]
    for r in sorted(rows, key=lambda r: (r.requests, r.tokens, order.get(r.connector, len(order)))):
        lines.append(f"{r.connector:<{width}} {r.requests:>8} {r.tokens:>6} {r.new_tokens:>7} {ms(r.prefill_ms):>10} "
                     f"{ms(r.decode_first_token_ms):>11} {ms(r.ttft_ms):>8} "
                     f"{_ratio(r.decode_first_token_ms, best(r, 'decode_first_token_ms')):>16} "
                     f"{_ratio(r.ttft_ms, best(r, 'ttft_ms')):>11} {over_no_transfer(r):>16} {r.pulled_tokens:>7} "
                     f"{_same(r)}")
    return "\n".join(lines)
