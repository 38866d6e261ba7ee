"""Running DCP decode ranks in tests: as processes joined by gloo (the real collectives), or as
threads of one process sharing an exchange (``ThreadGroup``: the same collectives, cheap enough
for property tests with the rank count as an axis).

``decode_on_ranks`` is the model-level DCP run every test compares with the colocated one: each
rank prefills the batch on a whole-request pool of its own (the bytes a prefill node would send;
the same on every rank), lands its share (``kpool_pd.model.dcp_landing``), and decodes the batch to the
end in step with the other ranks; rank 0 reports (tokens, output digest, state digest) per request.
"""

from __future__ import annotations

import os
import tempfile
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.queues import Queue

import torch

from kpool_pd.kvcache import DcpConfig, DcpShard, NodeCache
from kpool_pd.model import DecodeSequence, ModelConfig, output_digest
from kpool_pd.model.colocated import GenerateRequest, prefill_batch
from kpool_pd.model.dcp_engine import DcpEngine
from kpool_pd.model.dcp_group import DcpGroup
from kpool_pd.model.dcp_landing import land_request
from kpool_pd.runtime.launch import child_context, start_child


@dataclass(frozen=True, kw_only=True)
class DcpCase:
    config: ModelConfig
    interleave: int | None  # None: the block size
    requests: tuple[GenerateRequest, ...]


def decode_on_ranks(group, case: DcpCase) -> list[tuple[tuple[int, ...], str, str | None]]:
    """One rank's part of a DCP run of ``case`` (``group``: a ``DcpGroup`` or a ``ThreadGroup``)."""
    config, requests, device = case.config, case.requests, group.device
    full = prefill_batch(config, requests, device)
    shard = group.shard
    local_sizes = [shard.blocks_for_tokens(config.cache, config.cache.positions_written(
        len(r.prompt), r.max_tokens)) for r in requests]
    cache = NodeCache(config.cache, num_blocks=max(1, sum(local_sizes)), num_rings=len(requests),
                      device=device)
    cache.pool.blocks.fill_(0xA5)  # unwritten bytes that a rank reads would show
    engine = DcpEngine(config, cache.pool, group)
    local = [cache.allocate(r.request_id, size) for r, size in zip(requests, local_sizes)]
    try:
        sequences = []
        for req, whole, mine, first in zip(requests, full.allocations, local, full.first_tokens):
            land_request(full.cache.pool, list(whole.block_ids), whole.ring_id, cache.pool, list(mine.block_ids),
                         mine.ring_id, shard, len(req.prompt))
            sequences.append(DecodeSequence(request_id=req.request_id, prompt_len=len(req.prompt),
                                            max_tokens=req.max_tokens, allocation=mine, output=[first]))
        full.release()
        while not all(s.finished for s in sequences):
            engine.decode_step(sequences)
        return [(tuple(s.output), output_digest(s.output), engine.state_digest(s.block_ids, s.ring_id, s.cached))
                for s in sequences]
    finally:
        full.release()
        for allocation in local:
            allocation.release()


class ThreadGroup:
    """``DcpGroup``'s collectives among threads of one process (one ``ThreadGroup`` per thread,
    sharing an ``Exchange``)."""

    class Exchange:
        def __init__(self, size: int, timeout_s: float) -> None:
            self.size, self.timeout_s = size, timeout_s
            self.barrier = threading.Barrier(size, timeout=timeout_s)
            self.slots: list[torch.Tensor | None] = [None] * size

    def __init__(self, shard: DcpShard, exchange: ThreadGroup.Exchange) -> None:
        self.shard, self.exchange, self.device = shard, exchange, torch.device("cpu")
        self.size, self.rank = shard.size, shard.rank

    def _swap(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        ex = self.exchange
        ex.slots[self.rank] = tensor.clone()
        ex.barrier.wait()
        parts = [t.clone() for t in ex.slots]
        ex.barrier.wait()
        return parts

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._swap(tensor))

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._swap(tensor)).sum(dim=0)

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        parts = self._swap(tensor)
        return parts if self.rank == 0 else None


def run_threads(size: int, interleave: int, work: Callable, *args, timeout_s: float = 120.0) -> list:
    """``work(group, *args)`` on ``size`` thread ranks; every rank's result, in rank order."""
    exchange = ThreadGroup.Exchange(size, timeout_s)
    results: list = [None] * size
    errors: list[str] = []

    def rank_main(rank: int) -> None:
        try:
            results[rank] = work(ThreadGroup(DcpShard(size=size, rank=rank, interleave=interleave), exchange), *args)
        except BaseException:  # reported below; the barrier is broken so the others stop too
            errors.append(traceback.format_exc())
            exchange.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise AssertionError("a thread rank failed:\n" + "\n".join(errors))
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"thread ranks did not finish within {timeout_s} s")
    return results


def _process_main(rank: int, size: int, store: str, cases: Sequence[DcpCase], out: Queue, device: str) -> None:
    torch.set_num_threads(1)
    try:
        device = f"cuda:{rank}" if device == "cuda" else device
        world = DcpGroup.join(DcpShard(size=size, rank=rank, interleave=1), init_method=f"file://{store}",
                              device=device, timeout_s=120)
        results = []
        for case in cases:
            interleave = DcpConfig.for_cache(case.config.cache, size=size, interleave=case.interleave).interleave
            group = DcpGroup(DcpShard(size=size, rank=rank, interleave=interleave), device, world._group)
            results.append(decode_on_ranks(group, case))
        out.put((rank, results, None))
        world.leave()
    except BaseException:
        out.put((rank, None, traceback.format_exc()))


def run_processes(size: int, cases: Sequence[DcpCase], *, timeout_s: float = 240.0, device: str = "cpu") -> list[list]:
    """Every case on ``size`` rank processes; rank 0's results per case. ``device`` cpu: joined by gloo;
    cuda: rank r on cuda:r, joined by NCCL."""
    out = child_context().Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [start_child(_process_main, r, size, store, list(cases), out, device) for r in range(size)]
        try:
            reports = {}
            for _ in range(size):
                rank, results, error = out.get(timeout=timeout_s)
                if error:
                    raise AssertionError(f"rank {rank} failed:\n{error}")
                reports[rank] = results
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    return reports[0]
