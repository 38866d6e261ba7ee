"""The load a fleet run sends, and how its replies are judged.

Prompts: ``distinct`` seeded prompts whose lengths are skewed (most short, a share ``long_share`` long) or
balanced (every one of the skewed set's mean length, so both carry the same tokens); requests cycle over
them. Every reply is compared with the colocated run of its prompt (tokens, output and state digests),
byte for byte. Clients: ``clients`` concurrent loops, request ``i`` to decode daemon ``i % D``, each request
timed from its sending (time to first token, its end).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kpool_pd.decode_worker.client import RequestFailed, generate_one
from kpool_pd.decode_worker import api
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import GenerateRequest, make_prompts, run_colocated

REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Prompt lengths and counts of a run."""

    requests: int
    distinct: int = 64
    short: tuple[int, int] = (16, 96)  # token counts, inclusive
    long: tuple[int, int] = (640, 1024)
    long_share: float = 0.1
    max_tokens: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.distinct < 1 or self.max_tokens < 1:
            raise ValueError(f"requests, distinct and max_tokens must be >= 1, got {self.requests}, "
                             f"{self.distinct}, {self.max_tokens}")
        if not 0 <= self.long_share <= 1:
            raise ValueError(f"long_share must be in [0, 1], got {self.long_share}")
        for name in ("short", "long"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must be 1 <= low <= high, got {getattr(self, name)}")

    def lengths(self, skewed: bool) -> list[int]:
        rng = random.Random(self.seed)
        skew = [rng.randint(*self.long) if rng.random() < self.long_share else rng.randint(*self.short)
                for _ in range(self.distinct)]
        return skew if skewed else [round(statistics.fmean(skew))] * self.distinct

    def prompts(self, config: ModelConfig, skewed: bool) -> list[GenerateRequest]:
        """The distinct prompts, ``prompt-<i>``."""
        lengths = self.lengths(skewed)
        base = make_prompts(self.distinct, max(lengths), seed=self.seed, vocab_size=config.vocab_size,
                            max_tokens=self.max_tokens, prefix="prompt")
        return [GenerateRequest(request_id=p.request_id, prompt=p.prompt[:n], max_tokens=self.max_tokens)
                for p, n in zip(base, lengths)]


@dataclass(frozen=True)
class Expected:
    tokens: tuple[int, ...]
    output_digest: str
    state_digest: str


def expected(config: ModelConfig, prompts: Sequence[GenerateRequest]) -> dict[tuple[int, ...], Expected]:
    """The colocated run's reply for each prompt."""
    return {r.prompt: Expected(res.tokens, res.output_digest, res.state_digest)
            for r, res in zip(prompts, run_colocated(config, prompts))}


@dataclass(frozen=True, kw_only=True)
class Reply:
    """One request as a client saw it: times are monotonic seconds; ``error`` is ``CODE: message`` or empty."""

    request_id: str
    prompt: tuple[int, ...]
    decode: str
    sent: float
    ended: float
    ttft_ms: float
    tokens: tuple[int, ...] = ()
    output_digest: str = ""
    state_digest: str = ""
    error: str = ""

    def matches(self, want: Expected) -> bool:
        return (self.tokens, self.output_digest, self.state_digest) == (want.tokens, want.output_digest,
                                                                        want.state_digest)


async def _one(stub: api.GenerateServiceStub, decode: str, request: GenerateRequest) -> Reply:
    """One request through the client's own ``generate_one``, as a Reply (its failure as ``error``)."""
    sent = time.monotonic()
    try:
        result = await generate_one(stub, request, token=None, timeout_s=REQUEST_TIMEOUT_S)
    except RequestFailed as exc:
        return Reply(request_id=request.request_id, prompt=request.prompt, decode=decode, sent=sent,
                     ended=time.monotonic(), ttft_ms=0.0, error=f"{exc.code.name}: {exc.message}")
    return Reply(request_id=request.request_id, prompt=request.prompt, decode=decode, sent=sent,
                 ended=time.monotonic(), ttft_ms=result.ttft_ms, tokens=result.tokens,
                 output_digest=result.output_digest, state_digest=result.state_digest)


async def drive(decodes: Sequence[str], prompts: Sequence[GenerateRequest], requests: int, clients: int, *,
                tag: str) -> list[Reply]:
    """``requests`` requests over ``prompts`` (in turn) from ``clients`` concurrent clients; request ``i`` goes
    to ``decodes[i % len(decodes)]``; replies in request order."""
    channels = [grpc.aio.insecure_channel(address) for address in decodes]
    stubs = [api.GenerateServiceStub(c) for c in channels]
    replies: list[Reply | None] = [None] * requests
    turn = iter(range(requests))

    async def client() -> None:
        for i in turn:
            base = prompts[i % len(prompts)]
            request = GenerateRequest(request_id=f"{tag}-{i}", prompt=base.prompt, max_tokens=base.max_tokens)
            replies[i] = await _one(stubs[i % len(stubs)], decodes[i % len(decodes)], request)

    try:
        await asyncio.gather(*(client() for _ in range(clients)))
    finally:
        for channel in channels:
            await channel.close()
    return replies


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``; 0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def summary(replies: Sequence[Reply], want: dict[tuple[int, ...], Expected]) -> dict:
    """Counts (ok, failed, mismatched against the colocated run), time to first token (p50, p99, ms) and
    throughput of a phase."""
    ok = [r for r in replies if not r.error]
    ttft = [r.ttft_ms for r in ok]
    span = max(r.ended for r in replies) - min(r.sent for r in replies) if replies else 0.0
    return {"requests": len(replies), "ok": len(ok), "failed": len(replies) - len(ok),
            "mismatched": sum(not r.matches(want[r.prompt]) for r in ok),
            "ttft_p50_ms": round(percentile(ttft, 50), 2), "ttft_p99_ms": round(percentile(ttft, 99), 2),
            "seconds": round(span, 2), "requests_per_s": round(len(replies) / span, 1) if span else 0.0,
            "errors": sorted({r.error for r in replies if r.error})[:5]}
