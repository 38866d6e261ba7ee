"""CUDA graphs of the decode step's forward: one graph per padded bucket, as vLLM captures its decodes.

A bucket is (R requests, M table columns): every request brings 1 + num_spec tokens (its last token and
its drafts), so a bucket's shapes are fixed. A step of r <= R requests whose block tables are at most M
wide runs the smallest bucket that holds it: the step's inputs are copied into the bucket's persistent
buffers (one host-to-device copy of one packed int64 buffer), the graph is replayed, and each row's
chained hash comes back (the step's one host synchronisation). The engine derives tokens from the hashes
on the host.

Padding (``RequestPadding``): a padded request has ring id -1, an all -1 block table and seq_len 0, and its
tokens positions -1, so it writes nothing (the update skips a negative ring, the MLA write a negative position)
and selects nothing (no complete pool or group below seq_len 0). The kpool family's padded requests bring their
K tokens each (TOKENS); the QSA family's bring none (EMPTY: query length 0, as its metadata builder is captured;
the padding tokens follow the real ones and belong to no request, the builder gives them no slot). Padding rows'
hashes are discarded.

MRoPE (``mrope``, the QSA family): a decode token is text, so every axis of its MRoPE position is its position
plus its request's delta (the prompt's largest position + 1 - its length: 0 for a text prompt); the bucket
carries the deltas and its batch the [T, 3] positions they give.

A graph is captured the first time its bucket is needed (or all request buckets at once: ``capture_all``, which
a daemon runs at start), on an all-padded batch (the capture's warm-up run
then compiles the kernels and writes nothing), with every graph's memory from one pool.
"""

from __future__ import annotations

import logging
import time
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kpool_pd.model.batch import ForwardBatch
from kpool_pd.model.graph_capture import Chunk, PackedInput, bucket_size, capture, padded_rows, request_buckets, table_width

logger = logging.getLogger(__name__)


class RequestPadding(enum.Enum):
    """What a bucket's padded requests bring (see the module docstring)."""

    TOKENS = "tokens"  # K tokens each, at positions -1 (the kpool ops skip them)
    EMPTY = "empty"  # no token: query length 0; the padding tokens belong to no request (the QSA metadata builder)


@dataclass(frozen=True)
class DecodeBucket:
    requests: int
    table_width: int


class BucketGraph:
    """One bucket's persistent inputs, its captured forward and the hashes it leaves.

    Packed int64 input, in order: tokens [R*K], positions [R*K], query_start_loc [R+1], start_pos [R],
    seq_lens [R], ring_ids [R], block_table [R*M], mrope_deltas [R].
    """

    def __init__(self, bucket: DecodeBucket, tokens_per_request: int, device: torch.device, *,
                 padding: RequestPadding = RequestPadding.TOKENS, mrope: bool = False) -> None:
        self.bucket, self.k, self.padding, self.mrope = bucket, tokens_per_request, padding, mrope
        r, m, k = bucket.requests, bucket.table_width, tokens_per_request
        self.input = PackedInput((r * k, r * k, r + 1, r, r, r, r * m, r), device)
        # the padding of a step of no request (a step overwrites the real requests' part)
        tokens, positions, starts, start_pos, seq_lens, ring_ids, table, deltas = self.input.host()
        self._padding = [(field, value) for field, value in ((tokens, 0), (positions, -1), (start_pos, 0),
                                                             (seq_lens, 0), (ring_ids, -1), (table, -1), (deltas, 0))]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hashes: torch.Tensor | None = None

    def batch(self) -> ForwardBatch:
        """The bucket's batch over its persistent buffers (int32 fields converted inside the graph). Its host copies
        are a step of no request: the metadata's host counts (``QsaMetadataBuilder``'s split) are the capture's,
        which no op of a step reads; a replay rebuilds the device maps alone."""
        r, m, k = self.bucket.requests, self.bucket.table_width, self.k
        tokens, positions, starts, start_pos, seq_lens, ring_ids, table, deltas = self.input.device()
        rows = torch.arange(r * k, device=tokens.device)
        token_request = rows // k  # a padding token of EMPTY padding falls in a padded request: it writes nothing
        mrope = (positions + deltas[token_request])[:, None].expand(-1, 3).contiguous() if self.mrope else None
        return ForwardBatch(tokens=tokens, positions=positions, query_start_loc=starts.to(torch.int32),
                            start_pos=start_pos.to(torch.int32), seq_lens=seq_lens.to(torch.int32),
                            block_table=table.view(r, m).to(torch.int32), ring_ids=ring_ids.to(torch.int32),
                            rows=rows, token_request=token_request, query_start_loc_cpu=torch.zeros(1, dtype=torch.int32),
                            seq_lens_cpu=torch.zeros(0, dtype=torch.int32), mrope_positions=mrope)

    def fill(self, chunks: Sequence[Chunk], mrope_deltas: Sequence[int] | None = None) -> None:
        """Write ``chunks`` (each of exactly K tokens), their MRoPE deltas (None: 0 each) and the padding into the
        host buffer, then copy it over.

        # -> the device fields: [sum(sizes)] int64
        """
        r, m, k = self.bucket.requests, self.bucket.table_width, self.k
        tokens, positions, starts, start_pos, seq_lens, ring_ids, table, deltas = self.input.host()
        for field, value in self._padding:
            field.fill_(value)
        n = len(chunks)
        lengths = torch.full((r,), k if self.padding is RequestPadding.TOKENS else 0, dtype=torch.int64)
        lengths[:n] = k
        starts[0] = 0
        torch.cumsum(lengths, 0, out=starts[1:])
        if n:
            first = torch.tensor([start for _, start, _, _ in chunks], dtype=torch.int64)
            tokens[:n * k] = torch.tensor([t for ids, *_ in chunks for t in ids], dtype=torch.int64)
            positions[:n * k] = (first[:, None] + torch.arange(k)).flatten()
            start_pos[:n] = first
            seq_lens[:n] = first + k
            ring_ids[:n] = torch.tensor([ring for *_, ring in chunks], dtype=torch.int64)
            table[:n * m] = torch.tensor(padded_rows([blocks for _, _, blocks, _ in chunks], m), dtype=torch.int64)
            if mrope_deltas is not None:
                deltas[:n] = torch.tensor(list(mrope_deltas), dtype=torch.int64)
        self.input.upload()


class DecodeGraphs:
    """The decode forward of one engine (``forward``: ForwardBatch -> [Q] int64 hashes, no host
    synchronisation), replayed from CUDA graphs for steps of up to ``max_requests`` requests, whose buckets pad
    with ``padding`` and, with ``mrope``, carry the requests' MRoPE deltas. Only a CUDA device captures graphs
    (``capture``; the engine refuses graphs on another)."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], *, tokens_per_request: int,
                 block_size: int, max_requests: int, device: torch.device, table_width: int = 1,
                 padding: RequestPadding = RequestPadding.TOKENS, mrope: bool = False) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.forward, self.k, self.block_size = forward, tokens_per_request, block_size
        self.max_requests, self.device = max_requests, device
        self.padding, self.mrope = padding, mrope
        self.table_width = bucket_size(table_width)  # the narrowest table a bucket has (wider steps widen it)
        self._graphs: dict[DecodeBucket, BucketGraph] = {}
        self._memory = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

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

    def run(self, chunks: Sequence[Chunk], mrope_deltas: Sequence[int] | None = None) -> list[int]:
        """Every row's hash of the step's ``chunks`` (each of K tokens), in row order; ``mrope_deltas``: each
        chunk's MRoPE delta (None: text, 0 each; graphs with ``mrope`` only)."""
        if not self.serves(len(chunks)):
            raise ValueError(f"a graphed step holds 1 to {self.max_requests} requests, got {len(chunks)}")
        if any(len(ids) != self.k for ids, *_ in chunks):
            raise ValueError(f"every request of a graphed step brings {self.k} tokens, got "
                             f"{sorted({len(ids) for ids, *_ in chunks})}")
        if mrope_deltas is not None and (len(mrope_deltas) != len(chunks) or (not self.mrope and any(mrope_deltas))):
            raise ValueError(f"mrope_deltas {list(mrope_deltas)} for {len(chunks)} requests: one each, and only where "
                             "the graphs carry MRoPE positions")
        bucket = self.bucket_of(chunks)
        graph = self._graphs.get(bucket) or self._capture(bucket)
        graph.fill(chunks, mrope_deltas)
        graph.graph.replay()
        return graph.hashes[:len(chunks) * self.k].tolist()

    def _capture(self, bucket: DecodeBucket) -> BucketGraph:
        began = time.perf_counter()
        graph = BucketGraph(bucket, self.k, self.device, padding=self.padding, mrope=self.mrope)
        graph.fill(())  # the warm-up run writes nothing: every request is padding
        graph.graph, graph.hashes = capture(lambda: self.forward(graph.batch()), self._memory, self.device)
        self._graphs[bucket] = graph
        logger.info("captured the decode graph of %d requests x %d tokens, %d blocks wide, in %.0f ms",
                    bucket.requests, self.k, bucket.table_width, (time.perf_counter() - began) * 1000)
        return graph
