"""CUDA graphs of the decode step's forward: one graph per padded bucket, as vLLM captures its decodes.

A bucket is (R requests, M table columns): every request brings 1 + num_spec tokens (its last token and
its drafts), so a bucket's shapes are fixed. A step of r <= R requests whose block tables are at most M
wide runs the smallest bucket that holds it: the step's inputs are copied into the bucket's persistent
buffers (one host-to-device copy of one packed int64 buffer), the graph is replayed, and each row's
chained hash comes back (the step's one host synchronisation). The engine derives tokens from the hashes
on the host.

Padding: a padded request has ring id -1, an all -1 block table, seq_len 0 and positions -1, so it writes
nothing (the update skips a negative ring, the MLA write a negative position) and selects nothing (no
complete pool below seq_len 0). Its rows' hashes are discarded.

A graph is captured the first time its bucket is needed (or all request buckets at once: ``capture_all``, which
a daemon runs at start), on an all-padded batch (the capture's warm-up run
then compiles the kernels and writes nothing), with every graph's memory from one pool.
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


@dataclass(frozen=True)
class DecodeBucket:
    requests: int
    table_width: int


class BucketGraph:
    """One bucket's persistent inputs, its captured forward and the hashes it leaves.

    Packed int64 input, in order: tokens [R*K], positions [R*K], query_start_loc [R+1], start_pos [R],
    seq_lens [R], ring_ids [R], block_table [R*M].
    """

    def __init__(self, bucket: DecodeBucket, tokens_per_request: int, device: torch.device) -> None:
        self.bucket, self.k = bucket, tokens_per_request
        r, m, k = bucket.requests, bucket.table_width, tokens_per_request
        self.input = PackedInput((r * k, r * k, r + 1, r, r, r, r * m), device)
        # the fields no step changes: query_start_loc, and the padding of a step of no request
        tokens, positions, starts, start_pos, seq_lens, ring_ids, table = self.input.host()
        starts.copy_(torch.arange(0, (r + 1) * k, k))
        self._padding = [(field, value) for field, value in ((tokens, 0), (positions, -1), (start_pos, 0),
                                                             (seq_lens, 0), (ring_ids, -1), (table, -1))]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hashes: torch.Tensor | None = None

    def batch(self) -> ForwardBatch:
        """The bucket's batch over its persistent buffers (int32 fields converted inside the graph)."""
        r, m, k = self.bucket.requests, self.bucket.table_width, self.k
        tokens, positions, starts, start_pos, seq_lens, ring_ids, table = self.input.device()
        rows = torch.arange(r * k, device=tokens.device)
        return ForwardBatch(tokens=tokens, positions=positions, query_start_loc=starts.to(torch.int32),
                            start_pos=start_pos.to(torch.int32), seq_lens=seq_lens.to(torch.int32),
                            block_table=table.view(r, m).to(torch.int32), ring_ids=ring_ids.to(torch.int32),
                            rows=rows, token_request=rows // k)

    def fill(self, chunks: Sequence[Chunk]) -> None:
        """Write ``chunks`` (each of exactly K tokens) and the padding into the host buffer, then copy it over.

        # -> the device fields: [sum(sizes)] int64
        """
        m, k = self.bucket.table_width, self.k
        tokens, positions, _, start_pos, seq_lens, ring_ids, table = self.input.host()
        for field, value in self._padding:
            field.fill_(value)
        n = len(chunks)
        if n:
            first = torch.tensor([start for _, start, _, _ in chunks], dtype=torch.int64)
            tokens[:n * k] = torch.tensor([t for ids, *_ in chunks for t in ids], dtype=torch.int64)
            positions[:n * k] = (first[:, None] + torch.arange(k)).flatten()
            start_pos[:n] = first
            seq_lens[:n] = first + k
            ring_ids[:n] = torch.tensor([ring for *_, ring in chunks], dtype=torch.int64)
            table[:n * m] = torch.tensor(padded_rows([blocks for _, _, blocks, _ in chunks], m), dtype=torch.int64)
        self.input.upload()


class DecodeGraphs:
    """The decode forward of one engine (``forward``: ForwardBatch -> [Q] int64 hashes, no host
    synchronisation), replayed from CUDA graphs for steps of up to ``max_requests`` requests."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], *, tokens_per_request: int,
                 block_size: int, max_requests: int, device: torch.device, table_width: int = 1) -> None:
        if device.type != "cuda":
            raise ValueError(f"decode graphs need a CUDA device, got {device}")
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.forward, self.k, self.block_size = forward, tokens_per_request, block_size
        self.max_requests, self.device = max_requests, device
        self.table_width = bucket_size(table_width)  # the narrowest table a bucket has (wider steps widen it)
        self._graphs: dict[DecodeBucket, BucketGraph] = {}
        self._memory = torch.cuda.graph_pool_handle()

    def serves(self, num_requests: int) -> bool:
        return 1 <= num_requests <= self.max_requests

    def bucket_of(self, chunks: Sequence[Chunk]) -> DecodeBucket:
        width = table_width(chunks, self.block_size)
        return DecodeBucket(requests=min(bucket_size(len(chunks)), self.max_requests),
                            table_width=max(bucket_size(width), self.table_width))

    def capture_all(self) -> None:
        """Capture every request bucket (1, 2, 4, .. max_requests) at the narrowest table width, so that no
        step of such tables pays a capture."""
        for requests in request_buckets(self.max_requests):
            bucket = DecodeBucket(requests=requests, table_width=self.table_width)
            if bucket not in self._graphs:
                self._capture(bucket)

    def run(self, chunks: Sequence[Chunk]) -> list[int]:
        """Every row's hash of the step's ``chunks`` (each of K tokens), in row order."""
        if not self.serves(len(chunks)):
            raise ValueError(f"a graphed step holds 1 to {self.max_requests} requests, got {len(chunks)}")
        if any(len(ids) != self.k for ids, *_ in chunks):
            raise ValueError(f"every request of a graphed step brings {self.k} tokens, got "
                             f"{sorted({len(ids) for ids, *_ in chunks})}")
        bucket = self.bucket_of(chunks)
        graph = self._graphs.get(bucket) or self._capture(bucket)
        graph.fill(chunks)
        graph.graph.replay()
        return graph.hashes[:len(chunks) * self.k].tolist()

    def _capture(self, bucket: DecodeBucket) -> BucketGraph:
        began = time.perf_counter()
        graph = BucketGraph(bucket, self.k, self.device)
        graph.fill(())  # the warm-up run writes nothing: every request is padding
        graph.graph, graph.hashes = capture(lambda: self.forward(graph.batch()), self._memory, self.device)
        self._graphs[bucket] = graph
        logger.info("captured the decode graph of %d requests x %d tokens, %d blocks wide, in %.0f ms",
                    bucket.requests, self.k, bucket.table_width, (time.perf_counter() - began) * 1000)
        return graph
