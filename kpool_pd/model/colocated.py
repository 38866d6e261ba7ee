"""The colocated runner: prefill and decode in one process on one pool, no transfer.

It is the reference that every PD run must match byte for byte: the same engine, the same
per-request results (tokens, output digest, state digest), whatever the batching.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kpool_pd.kvcache import CacheAllocation, NodeCache
from kpool_pd.model.config import ModelConfig
from kpool_pd.model.engine import DecodeSequence, Engine, PrefillJob, output_digest
from kpool_pd.model.prompt import mrope_delta

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """``mrope_positions``: one (time, height, width) a prompt token (``kpool_pd.model.prompt.check_mrope_positions``),
    or (): text."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    mrope_positions: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True, kw_only=True)
class RequestResult:
    """What a run reports per request (``kpool-pd up`` prints these fields)."""

    request_id: str
    prompt_len: int
    tokens: tuple[int, ...]
    output_digest: str
    state_digest: str
    transfer_bytes: int = 0
    transfer_ms: float = 0.0  # moving all of its bytes (connector.decode.landed.TransferTimes)
    prefill_ms: float = 0.0  # the prompt on the prefill node
    exposed_transfer_ms: float = 0.0  # end of the prompt's compute to every byte on the decode node
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    steps: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    transport: str = "none"
    prefill_worker: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "request_id": self.request_id, "prompt_len": self.prompt_len, "tokens": list(self.tokens),
            "output_digest": self.output_digest, "state_digest": self.state_digest,
            "transfer_bytes": self.transfer_bytes, "transfer_ms": round(self.transfer_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3), "exposed_transfer_ms": round(self.exposed_transfer_ms, 3),
            "ttft_ms": round(self.ttft_ms, 3), "total_ms": round(self.total_ms, 3), "steps": self.steps,
            "drafts_proposed": self.drafts_proposed, "drafts_accepted": self.drafts_accepted,
            "transport": self.transport, "prefill_worker": self.prefill_worker,
        }


def make_prompts(count: int, prompt_len: int, *, seed: int, vocab_size: int, max_tokens: int,
                 prefix: str = "req") -> list[GenerateRequest]:
    """``count`` seeded prompts of ``prompt_len`` tokens each."""
    if count < 0 or prompt_len < 1 or max_tokens < 1:
        raise ValueError(f"need count >= 0, prompt_len >= 1, max_tokens >= 1; got {count}, {prompt_len}, {max_tokens}")
    gen = torch.Generator().manual_seed(seed + 7919)
    return [GenerateRequest(request_id=f"{prefix}-{i}", max_tokens=max_tokens,
                            prompt=tuple(torch.randint(0, vocab_size, (prompt_len,), generator=gen).tolist()))
            for i in range(count)]


def cache_for(config: ModelConfig, requests: Sequence[GenerateRequest], max_batch: int,
              device: torch.device | str = "cpu") -> NodeCache:
    """A node cache on ``device`` that holds the ``max_batch`` largest requests at once."""
    sizes = sorted((config.cache.blocks_for_request(len(r.prompt), r.max_tokens) for r in requests), reverse=True)
    return NodeCache(config.cache, num_blocks=max(1, sum(sizes[:max_batch])),
                     num_rings=max(1, min(max_batch, len(requests))), device=device)


@dataclass(frozen=True)
class PrefilledBatch:
    """Every request of a batch prefilled at once on a cache of its own (what prefill nodes would
    send): ``allocations[i]`` holds request i's blocks and ring; ``release()`` gives them all back."""

    engine: Engine
    cache: NodeCache
    allocations: tuple[CacheAllocation, ...]
    first_tokens: tuple[int, ...]

    def release(self) -> None:
        for allocation in self.allocations:
            allocation.release()


def prefill_batch(config: ModelConfig, requests: Sequence[GenerateRequest],
                  device: torch.device | str = "cpu") -> PrefilledBatch:
    """Prefill every request of ``requests`` in one step on a cache that holds them all."""
    cache = cache_for(config, requests, len(requests), device)
    engine = Engine(config, cache.pool)
    allocations = tuple(cache.allocate(r.request_id, config.cache.blocks_for_request(len(r.prompt), r.max_tokens)) for r in requests)
    try:
        firsts = engine.prefill([PrefillJob(prompt=r.prompt, block_ids=a.block_ids, ring_id=a.ring_id,
                                            mrope_positions=r.mrope_positions) for r, a in zip(requests, allocations)])
    except BaseException:
        for allocation in allocations:
            allocation.release()
        raise
    return PrefilledBatch(engine, cache, allocations, tuple(firsts))


def run_colocated(config: ModelConfig, requests: Sequence[GenerateRequest], *, max_batch: int = 16,
                  on_result: Callable[[RequestResult], None] | None = None,
                  device: torch.device | str = "cpu", graph_requests: int = 0) -> list[RequestResult]:
    """Run every request to completion with continuous batching of up to ``max_batch`` on a cache of
    its own (``cache_for``) on ``device`` (decode steps of up to ``graph_requests`` requests from CUDA graphs:
    ``Engine``); results in request order. Each request holds its blocks and
    ring as one allocation from admission to its result; every one is released at the end, also when
    a request fails."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    cache = cache_for(config, requests, max_batch, device)
    engine = Engine(config, cache.pool, graph_requests=graph_requests)
    held: dict[str, CacheAllocation] = {}
    try:
        return _run(engine, cache, requests, max_batch, held, on_result)
    finally:
        for allocation in held.values():
            allocation.release()


def _run(engine: Engine, cache: NodeCache, requests: Sequence[GenerateRequest], max_batch: int,
         held: dict[str, CacheAllocation], on_result: Callable[[RequestResult], None] | None) -> list[RequestResult]:
    config = engine.config
    waiting = list(requests)
    running: list[DecodeSequence] = []
    results: dict[str, RequestResult] = {}
    ttft_ms: dict[str, float] = {}  # by request id, from prefill to the result
    started = time.perf_counter()
    while waiting or running:
        admitted: list[tuple[DecodeSequence, GenerateRequest]] = []
        while waiting and len(running) + len(admitted) < max_batch:
            req = waiting[0]
            need = config.cache.blocks_for_request(len(req.prompt), req.max_tokens)
            if not cache.fits(need):
                if not running and not admitted:
                    raise ValueError(f"request {req.request_id} needs {need} blocks; the pool has {cache.free_blocks} free")
                break
            waiting.pop(0)
            allocation = held[req.request_id] = cache.allocate(req.request_id, need)
            seq = DecodeSequence(request_id=req.request_id, prompt_len=len(req.prompt), max_tokens=req.max_tokens,
                                 allocation=allocation, output=[],
                                 mrope_delta=mrope_delta(req.mrope_positions, len(req.prompt)))
            admitted.append((seq, req))
        if admitted:
            firsts = engine.prefill([PrefillJob(prompt=req.prompt, block_ids=seq.block_ids, ring_id=seq.ring_id,
                                                mrope_positions=req.mrope_positions) for seq, req in admitted])
            now = (time.perf_counter() - started) * 1000
            for (seq, _), token in zip(admitted, firsts):
                seq.output.append(token)
                ttft_ms[seq.request_id] = now
                running.append(seq)
        engine.decode_step(running)
        for seq in [s for s in running if s.finished]:
            running.remove(seq)
            result = RequestResult(
                request_id=seq.request_id, prompt_len=seq.prompt_len, tokens=tuple(seq.output),
                output_digest=output_digest(seq.output),
                state_digest=engine.state_digest(seq.block_ids, seq.ring_id, seq.cached),
                ttft_ms=ttft_ms.pop(seq.request_id), total_ms=(time.perf_counter() - started) * 1000, steps=seq.steps,
                drafts_proposed=seq.drafts_proposed, drafts_accepted=seq.drafts_accepted,
            )
            held.pop(seq.request_id).release()
            results[seq.request_id] = result
            if on_result is not None:
                on_result(result)
    return [results[r.request_id] for r in requests]
