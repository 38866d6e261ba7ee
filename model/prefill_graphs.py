"""CUDA graphs of prefill steps of one token count: a prefill daemon's steps hold ``max_batch_tokens`` prompt
tokens (one long prompt's chunk, or several short prompts) but for the last of a burst, so one count serves
nearly every step, and a replay costs the host a copy and a launch where an eager forward costs it every
layer's launches (bench/prefill_step.py measures both).

A bucket is (R requests, M table columns, hashed): a step of r <= R chunks of T tokens in all, whose block
tables are at most M wide, runs the smallest bucket that holds it. ``hashed`` graphs also compute each
request's chained hash (the step has a chunk that ends its prompt); the others only write the cache. A
padded request holds no token (its query_start_loc entry repeats T), ring id -1 and an all -1 block table,
so it writes nothing; its row is the step's last token, and its hash is discarded. Every chunk runs the
chunked kernels from its start position (a chunk from position 0 writes what the whole-prompt kernels write).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from model.batch import ForwardBatch
from model.decode_graphs import Chunk, bucket_size
from model.graph_capture import PackedInput, capture, padded_rows

logger = logging.getLogger(__name__)

# The forward a graph captures: the batch and whether to hash its rows -> [R] int64 hashes (None unhashed).
Forward = Callable[[ForwardBatch, bool], "torch.Tensor | None"]


@dataclass(frozen=True)
class PrefillBucket:
    requests: int
    table_width: int
    hashed: bool


class PrefillStepGraph:
    """One bucket's persistent inputs, its captured forward and the hashes it leaves.

    Packed int64 input, in order: tokens [T], positions [T], token_request [T], query_start_loc [R+1],
    start_pos [R], seq_lens [R], ring_ids [R], block_table [R*M], rows [R].
    """

    def __init__(self, bucket: PrefillBucket, tokens: int, device: torch.device) -> None:
        self.bucket, self.tokens = bucket, tokens
        r, m, t = bucket.requests, bucket.table_width, tokens
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
        """Write ``chunks`` (T tokens in all) and the padding into the host buffer, then copy it over. No chunks:
        the capture's warm-up step, whose T tokens (positions -1) belong to a request without blocks or ring, so
        that it writes and selects nothing.

        # -> the device fields: [sum(sizes)] int64
        """
        r, m, t = self.bucket.requests, self.bucket.table_width, self.tokens
        tokens, positions, token_request, starts, start_pos, seq_lens, ring_ids, table, rows = self.input.host()
        padding = r - len(chunks)
        ends = [0]
        for ids, *_ in chunks:
            ends.append(ends[-1] + len(ids))
        first = torch.tensor([start for _, start, _, _ in chunks] + [0] * padding, dtype=torch.int64)
        counts = torch.tensor([len(ids) for ids, *_ in chunks] + [0] * padding, dtype=torch.int64)
        if chunks:
            tokens.copy_(torch.tensor([tok for ids, *_ in chunks for tok in ids], dtype=torch.int64))
            before = torch.tensor(ends[:-1], dtype=torch.int64)
            positions.copy_(torch.repeat_interleave(first - torch.cat([before, torch.full((padding,), t)]), counts)
                            + torch.arange(t))
            token_request.copy_(torch.repeat_interleave(torch.arange(r), counts))
            starts.copy_(torch.tensor(ends + [t] * padding, dtype=torch.int64))
        else:
            tokens.zero_()
            positions.fill_(-1)
            token_request.zero_()
            starts.copy_(torch.tensor([0] + [t] * r, dtype=torch.int64))
        start_pos.copy_(first)
        seq_lens.copy_(first + counts)
        ring_ids.copy_(torch.tensor([ring for *_, ring in chunks] + [-1] * padding, dtype=torch.int64))
        table.copy_(torch.tensor(padded_rows([blocks for _, _, blocks, _ in chunks] + [()] * padding, m),
                                 dtype=torch.int64))
        rows.copy_(torch.tensor([end - 1 for end in ends[1:]] + [t - 1] * padding, dtype=torch.int64))
        self.input.upload()


class PrefillGraphs:
    """The prefill forward of one engine (``forward``), replayed from CUDA graphs for steps of exactly ``tokens``
    prompt tokens in up to ``max_requests`` chunks."""

    def __init__(self, forward: Forward, *, tokens: int, block_size: int, max_requests: int, device: torch.device,
                 table_width: int = 1) -> None:
        if device.type != "cuda":
            raise ValueError(f"prefill graphs need a CUDA device, got {device}")
        if tokens < 1 or max_requests < 1:
            raise ValueError(f"tokens and max_requests must be >= 1, got {tokens} and {max_requests}")
        self.forward, self.tokens, self.block_size = forward, tokens, block_size
        self.max_requests, self.device = max_requests, device
        self.table_width = bucket_size(table_width)
        self._graphs: dict[PrefillBucket, PrefillStepGraph] = {}
        self._memory = torch.cuda.graph_pool_handle()

    def serves(self, chunks: Sequence[Chunk]) -> bool:
        """Whether a step of these chunks replays a graph: ``tokens`` tokens in 1 to ``max_requests`` chunks."""
        return 1 <= len(chunks) <= self.max_requests and sum(len(ids) for ids, *_ in chunks) == self.tokens

    def bucket_of(self, chunks: Sequence[Chunk], hashed: bool) -> PrefillBucket:
        width = max(max(len(blocks), -(-(start + len(ids)) // self.block_size)) for ids, start, blocks, _ in chunks)
        return PrefillBucket(requests=min(bucket_size(len(chunks)), self.max_requests),
                             table_width=max(bucket_size(width), self.table_width), hashed=hashed)

    def capture_all(self) -> None:
        """Capture every request bucket (1, 2, 4, .. max_requests), hashed and not, at the narrowest table width."""
        requests = 1
        while True:
            for hashed in (False, True):
                bucket = PrefillBucket(requests=min(requests, self.max_requests), table_width=self.table_width,
                                       hashed=hashed)
                if bucket not in self._graphs:
                    self._capture(bucket)
            if requests >= self.max_requests:
                return
            requests *= 2

    def run(self, chunks: Sequence[Chunk], *, hashed: bool) -> list[int]:
        """Write the chunks' cache entries; with ``hashed``, each chunk's row hash (its last token's), in chunk
        order (read back: a host synchronisation); else [] (none: the caller waits for the writes to land before
        it fills the next step, whose host buffer this step's copy reads)."""
        if not self.serves(chunks):
            raise ValueError(f"a graphed prefill step holds {self.tokens} tokens in 1 to {self.max_requests} "
                             f"chunks, got {sum(len(ids) for ids, *_ in chunks)} in {len(chunks)}")
        bucket = self.bucket_of(chunks, hashed)
        graph = self._graphs.get(bucket) or self._capture(bucket)
        graph.fill(chunks)
        graph.graph.replay()
        return graph.hashes[:len(chunks)].tolist() if hashed else []

    def _capture(self, bucket: PrefillBucket) -> PrefillStepGraph:
        began = time.perf_counter()
        graph = PrefillStepGraph(bucket, self.tokens, self.device)
        graph.fill(())  # the warm-up run writes nothing: every request is padding
        graph.graph, graph.hashes = capture(lambda: self.forward(graph.batch(), bucket.hashed), self._memory,
                                            self.device)
        self._graphs[bucket] = graph
        logger.info("captured the prefill graph of %d tokens in %d requests, %d blocks wide%s, in %.0f ms",
                    self.tokens, bucket.requests, bucket.table_width, ", hashed" if bucket.hashed else "",
                    (time.perf_counter() - began) * 1000)
        return graph
