"""CUDA graphs of prefill steps, as vLLM captures its steps: a replay costs the host a copy and a launch where
an eager forward costs it every layer's launches (kpool_pd/bench/prefill_step.py measures both).

A bucket is (T tokens, R requests, M table columns, hashed): a step of r chunks of t tokens in all, whose
block tables are at most M wide, runs the smallest bucket that holds it: T the smallest of ``token_buckets``
(powers of two from ``MIN_GRAPH_TOKENS``, and the most a step holds: a prefill daemon's ``max_batch_tokens``,
which nearly every step of a burst fills) with t <= T, and R >= r, one more where t < T. ``hashed`` graphs
also compute each request's chained hash (the step has a chunk that ends its prompt); the others only write
the cache. Padding: the first padded request holds the T - t padding tokens (positions -1), the others none
(their query_start_loc entries repeat T); a padded request has ring id -1 and an all -1 block table, so it
writes nothing, and its row (the step's last token) selects nothing; its hash is discarded. Every chunk runs
the chunked kernels from its start position (a chunk from position 0 writes what the whole-prompt kernels
write).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kpool_pd.model.batch import ForwardBatch
from kpool_pd.model.graph_capture import Chunk, PackedInput, bucket_size, capture, padded_rows, request_buckets, table_width

logger = logging.getLogger(__name__)

MIN_GRAPH_TOKENS = 256  # the smallest token bucket: a step of fewer tokens pads up to it

# The forward a graph captures: the batch and whether to hash its rows -> [R] int64 hashes (None unhashed).
Forward = Callable[[ForwardBatch, bool], "torch.Tensor | None"]


def token_buckets(max_tokens: int) -> list[int]:
    """The token counts prefill graphs are captured for: powers of two from ``MIN_GRAPH_TOKENS`` below
    ``max_tokens``, then ``max_tokens``."""
    buckets, tokens = [], MIN_GRAPH_TOKENS
    while tokens < max_tokens:
        buckets.append(tokens)
        tokens *= 2
    return buckets + [max_tokens]


@dataclass(frozen=True)
class PrefillBucket:
    tokens: int
    requests: int
    table_width: int
    hashed: bool


def prefill_bucket(chunks: Sequence[Chunk], buckets: Sequence[int], *, max_requests: int, block_size: int,
                   min_width: int, hashed: bool) -> PrefillBucket | None:
    """The bucket a step of ``chunks`` replays: the smallest of the token ``buckets`` that holds its tokens, the
    requests it needs (the chunks, and one for the padding tokens where fewer than that) padded to a power of two
    and at most ``max_requests``, its table width padded to a power of two and at least ``min_width``; None where
    no bucket holds the step (no chunk, too many tokens or too many requests)."""
    total = sum(len(ids) for ids, *_ in chunks)
    tokens = next((t for t in buckets if total <= t), None)
    requests = len(chunks) + (tokens is not None and total < tokens)
    if not chunks or tokens is None or requests > max_requests:
        return None
    return PrefillBucket(tokens=tokens, requests=min(bucket_size(requests), max_requests),
                         table_width=max(bucket_size(table_width(chunks, block_size)), min_width), hashed=hashed)


class PrefillStepGraph:
    """One bucket's persistent inputs, its captured forward and the hashes it leaves.

    Packed int64 input, in order: tokens [T], positions [T], token_request [T], query_start_loc [R+1],
    start_pos [R], seq_lens [R], ring_ids [R], block_table [R*M], rows [R].
    """

    def __init__(self, bucket: PrefillBucket, device: torch.device) -> None:
        self.bucket = bucket
        r, m, t = bucket.requests, bucket.table_width, bucket.tokens
        self.input = PackedInput((t, t, t, r + 1, r, r, r, r * m, r), device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hashes: torch.Tensor | None = None

    def batch(self) -> ForwardBatch:
        """The bucket's batch over its persistent buffers (int32 fields converted inside the graph)."""
        r, m = self.bucket.requests, self.bucket.table_width
        tokens, positions, token_request, starts, start_pos, seq_lens, ring_ids, table, rows = self.input.device()
        return ForwardBatch(tokens=tokens, positions=positions, query_start_loc=starts.to(torch.int32),
                            start_pos=start_pos.to(torch.int32), seq_lens=seq_lens.to(torch.int32),
                            block_table=table.view(r, m).to(torch.int32), ring_ids=ring_ids.to(torch.int32),
                            rows=rows, token_request=token_request)

    def fill(self, chunks: Sequence[Chunk]) -> None:
        """Write ``chunks`` (at most T tokens in all, in fewer than R chunks where fewer than T) and the padding
        into the host buffer, then copy it over. No chunks: the capture's warm-up step, all padding, which
        writes and selects nothing.

        # -> the device fields: [sum(sizes)] int64
        """
        r, m, t = self.bucket.requests, self.bucket.table_width, self.bucket.tokens
        tokens, positions, token_request, starts, start_pos, seq_lens, ring_ids, table, rows = self.input.host()
        real = [len(ids) for ids, *_ in chunks]
        counts = real + [t - sum(real)] + [0] * (r - len(chunks) - 1) if len(chunks) < r else real
        first = [start for _, start, _, _ in chunks] + [0] * (r - len(chunks))
        padding = t - sum(real)
        tokens.copy_(torch.tensor([tok for ids, *_ in chunks for tok in ids] + [0] * padding, dtype=torch.int64))
        positions.copy_(torch.tensor([p for (ids, start, *_) in chunks for p in range(start, start + len(ids))]
                                     + [-1] * padding, dtype=torch.int64))
        counts_t = torch.tensor(counts, dtype=torch.int64)
        token_request.copy_(torch.repeat_interleave(torch.arange(r), counts_t))
        starts[0] = 0
        torch.cumsum(counts_t, 0, out=starts[1:])
        start_pos.copy_(torch.tensor(first, dtype=torch.int64))
        seq_lens.copy_(torch.tensor([s + n for s, n in zip(first, real)] + [0] * (r - len(chunks)), dtype=torch.int64))
        ring_ids.copy_(torch.tensor([ring for *_, ring in chunks] + [-1] * (r - len(chunks)), dtype=torch.int64))
        table.copy_(torch.tensor(padded_rows([blocks for _, _, blocks, _ in chunks] + [()] * (r - len(chunks)), m),
                                 dtype=torch.int64))
        ends = torch.cumsum(torch.tensor(real, dtype=torch.int64), 0) - 1
        rows.copy_(torch.cat([ends, torch.full((r - len(chunks),), t - 1, dtype=torch.int64)]))
        self.input.upload()


class PrefillGraphs:
    """The prefill forward of one engine (``forward``), replayed from CUDA graphs for steps of at most
    ``max_tokens`` prompt tokens in up to ``max_requests`` chunks (padding included)."""

    def __init__(self, forward: Forward, *, max_tokens: int, block_size: int, max_requests: int,
                 device: torch.device, table_width: int = 1) -> None:
        if device.type != "cuda":
            raise ValueError(f"prefill graphs need a CUDA device, got {device}")
        if max_tokens < 1 or max_requests < 1:
            raise ValueError(f"max_tokens and max_requests must be >= 1, got {max_tokens} and {max_requests}")
        self.forward, self.block_size = forward, block_size
        self.max_requests, self.device = max_requests, device
        self.token_buckets = token_buckets(max_tokens)
        self.table_width = bucket_size(table_width)
        self._graphs: dict[PrefillBucket, PrefillStepGraph] = {}
        self._memory = torch.cuda.graph_pool_handle()

    def serves(self, chunks: Sequence[Chunk]) -> bool:
        """Whether a step of these chunks replays a graph: at most ``max_tokens`` tokens in chunks that, with a
        padding request where needed, number at most ``max_requests``."""
        return self.bucket_of(chunks, False) is not None

    def bucket_of(self, chunks: Sequence[Chunk], hashed: bool) -> PrefillBucket | None:
        return prefill_bucket(chunks, self.token_buckets, max_requests=self.max_requests, block_size=self.block_size,
                              min_width=self.table_width, hashed=hashed)

    def capture_all(self) -> None:
        """Capture every bucket of the narrowest table width: each token count, 1, 2, 4, .. max_requests requests,
        hashed and not."""
        for tokens in self.token_buckets:
            for requests in request_buckets(self.max_requests):
                for hashed in (False, True):
                    bucket = PrefillBucket(tokens=tokens, requests=requests, table_width=self.table_width, hashed=hashed)
                    if bucket not in self._graphs:
                        self._capture(bucket)

    def run(self, chunks: Sequence[Chunk], *, hashed: bool) -> list[int] | None:
        """Write the chunks' cache entries; with ``hashed``, each chunk's row hash (its last token's), in chunk
        order (read back: a host synchronisation); else [] (none: the caller waits for the writes to land before
        it fills the next step, whose host buffer this step's copy reads). None, having done nothing, for a step
        no graph serves (``serves``): the caller runs it eagerly."""
        bucket = self.bucket_of(chunks, hashed)
        if bucket is None:
            return None
        graph = self._graphs.get(bucket) or self._capture(bucket)
        graph.fill(chunks)
        graph.graph.replay()
        return graph.hashes[:len(chunks)].tolist() if hashed else []

    def _capture(self, bucket: PrefillBucket) -> PrefillStepGraph:
        began = time.perf_counter()
        graph = PrefillStepGraph(bucket, self.device)
        graph.fill(())  # the warm-up run writes nothing: every token is padding
        graph.graph, graph.hashes = capture(lambda: self.forward(graph.batch(), bucket.hashed), self._memory,
                                            self.device)
        self._graphs[bucket] = graph
        logger.debug("captured the prefill graph of %d tokens in %d requests, %d blocks wide%s, in %.0f ms",
                     bucket.tokens, bucket.requests, bucket.table_width, ", hashed" if bucket.hashed else "",
                     (time.perf_counter() - began) * 1000)
        return graph
