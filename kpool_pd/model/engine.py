"""The batch engine: prefill and decode steps of the synthetic model on one ``CachePool``.

A decode step runs every running request at once: per layer one cache-update launch for all of
their tokens (each request's last committed token and its drafts), then one top-k launch for
every token of the batch; the target's next token of each token is derived from what it
selected (``kpool_pd.model.rule``). Drafts are then verified per request: draft i is accepted while it
equals the target's token after draft i - 1; the step commits the last token and the accepted
drafts, and the target's token after the last accepted one becomes the next step's first
token (DESIGN section 2). Rejected drafts' cache writes lie past the committed length and are
overwritten by the next step.

The engine owns no allocator: callers hand it block tables and rings. Not thread-safe; one
thread at a time may call it (the daemons call it from one worker thread).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kpool_pd.kernels import write_mla_rows
from kpool_pd.kvcache import CacheAllocation, CacheFamily, CachePool
from kpool_pd.model.batch import ForwardBatch, build_batch
from kpool_pd.model.cache_io import mla_destinations, request_mla_rows, request_ring_rows, write_mla
from kpool_pd.model.config import ModelConfig
from kpool_pd.model.decode_graphs import DecodeGraphs, RequestPadding
from kpool_pd.model.graph_capture import Chunk
from kpool_pd.model.kpool_family import KpoolFamily
from kpool_pd.model.prefill_graphs import PrefillGraphs
from kpool_pd.model.prompt import check_mrope_positions, check_prompt
from kpool_pd.model.qsa_family import QsaFamily
from kpool_pd.model.rule import TokenRule
from kpool_pd.model.weights import SyntheticWeights

logger = logging.getLogger(__name__)

# A forward that computes its layers' inputs at once does so for runs of layers of at most this many token-layers
# (about 3.5 KiB of temporaries each), so that a long prompt's forward holds a bounded workspace.
HOIST_TOKEN_LAYERS = 1 << 17


@dataclass(frozen=True, kw_only=True)
class PrefillJob:
    """One chunk of a prompt: positions ``[start, end)`` of ``prompt`` (``end`` None: to the prompt's end).
    A later chunk of the same request must start where the previous one ended, on the same blocks and ring
    (the ring carries the open pool or group across chunks). ``block_ids`` cover at least ``end`` tokens.
    ``mrope_positions``: the whole prompt's (time, height, width) a token (``check_mrope_positions``), or () for text."""

    prompt: Sequence[int]
    block_ids: Sequence[int]
    ring_id: int
    start: int = 0
    end: int | None = None
    mrope_positions: Sequence[Sequence[int]] = ()

    @property
    def stop(self) -> int:
        """The chunk's end position (exclusive)."""
        return len(self.prompt) if self.end is None else self.end

    @property
    def last(self) -> bool:
        """Whether this chunk ends the prompt (its first output token is then computed)."""
        return self.stop == len(self.prompt)

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


@dataclass(kw_only=True, eq=False)
class DecodeSequence:
    """A request being decoded. ``cached`` positions are committed in the cache; ``pending`` is
    the last emitted token (not yet in the cache); ``output`` holds every emitted token. ``mrope_delta``: what a
    generated token adds to its position for its MRoPE position (``kpool_pd.model.prompt.mrope_delta``; 0: text)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    allocation: CacheAllocation  # the request's blocks (block-table order) and ring, held by whoever runs it
    output: list[int]
    steps: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    mrope_delta: int = 0

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self.allocation.block_ids

    @property
    def ring_id(self) -> int:
        return self.allocation.ring_id

    @property
    def cached(self) -> int:
        return self.prompt_len + len(self.output) - 1

    @property
    def pending(self) -> int:
        return self.output[-1]

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.output)

    @property
    def finished(self) -> bool:
        return self.remaining <= 0


def output_digest(tokens: Sequence[int]) -> str:
    """sha256 of the token ids as little-endian uint32."""
    return hashlib.sha256(b"".join(int(t).to_bytes(4, "little") for t in tokens)).hexdigest()


def _on_pool_device(method):
    """Run an Engine method with the pool's CUDA device current, so that every kernel launches on
    the device its tensors live on, whichever thread calls (a thread's current device is cuda:0
    until set, and a daemon steps its engine in worker threads)."""
    @functools.wraps(method)
    def run(self: "Engine", *args, **kwargs):
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)
    return run


class Engine:
    """``graph_requests`` > 0 replays decode steps of up to that many requests from CUDA graphs
    (``kpool_pd.model.decode_graphs``; CUDA pools of either family), whose block tables are at least
    ``graph_table_width`` blocks wide; 0 runs every step eagerly. ``prefill_graph_tokens`` > 0 (kpool pools on CUDA) replays prefill
    steps of up to that many tokens in up to ``prefill_graph_requests`` chunks (padding included) from CUDA
    graphs (``kpool_pd.model.prefill_graphs``, the same table width); other steps run eagerly. On CUDA the kpool family's
    eager forwards, too, compute their layers' inputs in a few launches for many layers at once."""

    def __init__(self, config: ModelConfig, pool: CachePool, weights: SyntheticWeights | None = None, *,
                 graph_requests: int = 0, graph_table_width: int = 1, prefill_graph_tokens: int = 0,
                 prefill_graph_requests: int = 16) -> None:
        if pool.config != config.cache:
            raise ValueError("the pool's cache config is not the model's: build the pool from config.cache")
        self.config = config
        self.pool = pool
        self.device = pool.device
        self.weights = weights if weights is not None else SyntheticWeights(config, self.device)
        family_type = KpoolFamily if config.cache.family is CacheFamily.KPOOL else QsaFamily
        self.family: KpoolFamily | QsaFamily = family_type(config, self.weights, pool)
        self.rule = TokenRule(self.weights, self.family.feature_width)
        self.hoists = self.device.type == "cuda" and config.cache.family is CacheFamily.KPOOL
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        if graph_requests and self.device.type != "cuda":
            raise ValueError(f"decode graphs serve pools on CUDA; this engine's pool is {config.cache.family.value} "
                             f"on {self.device}")
        if prefill_graph_tokens and not self.hoists:
            raise ValueError(f"prefill graphs serve kpool pools on CUDA; this engine's pool is "
                             f"{config.cache.family.value} on {self.device}")
        if graph_requests:
            self.graphs = self._decode_graphs(graph_requests, graph_table_width)
        if prefill_graph_tokens:
            self.prefill_graphs = PrefillGraphs(
                lambda batch, hashed: self._hoisted_forward(batch, self.family.prefill, hashed=hashed),
                max_tokens=prefill_graph_tokens, block_size=config.cache.block_size, max_requests=prefill_graph_requests,
                device=self.device, table_width=graph_table_width)

    def _decode_graphs(self, max_requests: int, table_width: int) -> DecodeGraphs:
        """The decode graphs of this engine's family: the kpool family's buckets pad with whole requests; the QSA
        family's with empty ones, carry MRoPE deltas, and build their metadata in the builder's buffers, which
        first get room for the largest bucket."""
        per_request = 1 + self.config.cache.num_spec
        qsa = isinstance(self.family, QsaFamily)
        if qsa:
            self.family.reserve(max_requests * per_request, max_requests)
        return DecodeGraphs(self._graphed_forward, tokens_per_request=per_request,
                            block_size=self.config.cache.block_size, max_requests=max_requests, device=self.device,
                            table_width=table_width, padding=RequestPadding.EMPTY if qsa else RequestPadding.TOKENS,
                            mrope=qsa)

    @_on_pool_device
    def capture_graphs(self) -> None:
        """Capture the decode graph of every batch size now (``DecodeGraphs.capture_all``)."""
        if self.graphs is None:
            raise ValueError("this engine replays no decode graphs (graph_requests=0)")
        self.graphs.capture_all()

    @_on_pool_device
    def capture_prefill_graphs(self) -> None:
        """Capture the prefill graph of every request count now (``PrefillGraphs.capture_all``)."""
        if self.prefill_graphs is None:
            raise ValueError("this engine replays no prefill graphs (prefill_graph_tokens=0)")
        self.prefill_graphs.capture_all()

    # forwards ---------------------------------------------------------------------------
    def _hashes(self, batch: ForwardBatch) -> torch.Tensor:
        """Each row's chained hash over every layer (no host synchronisation on CUDA).

        # -> [Q] int64 in [0, P)
        """
        acc = self.rule.start(batch.rows.shape[0], self.device)
        for layer in range(self.config.num_layers):
            acc = self.family.chain(acc, layer, batch, self.rule)
        return self._combine(acc)

    def _decode_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """A decode step's cache writes, then its rows' hashes. # -> [Q] int64"""
        self._write(batch, self.family.decode)
        return self._hashes(batch)

    def _graphed_forward(self, batch: ForwardBatch) -> torch.Tensor:
        """``_decode_forward`` as a graph captures it: ``_hoisted_forward`` for the kpool family, the per-layer
        forward itself for QSA (its metadata built into the builder's buffers). The same bytes
        (tests/gpu/test_decode_graphs_gpu.py, tests/gpu/test_qsa_decode_graphs_gpu.py). # -> [Q] int64"""
        if isinstance(self.family, QsaFamily):
            return self._decode_forward(batch)
        return self._hoisted_forward(batch, self.family.decode, hashed=True)

    def _hoisted_forward(self, batch: ForwardBatch, update, *, hashed: bool) -> torch.Tensor | None:
        """A forward of the kpool family whose per-token inputs (keys, gates, MLA entries, the rows' queries) are
        computed for runs of layers at once (``layer_runs``), and the tokens' MLA rows once: per layer ``update``
        (the prefill or the decode update), the MLA write, and with ``hashed`` the top-k and the fused hash
        (after the run's writes: a layer's hash reads only that layer's cache). The bytes and hashes of the
        per-layer forwards (``_write`` then ``_hashes``). No host synchronisation.

        # -> [Q] int64 with ``hashed``, else None
        """
        blocks, offsets = mla_destinations(self.config.cache.block_size, batch.block_table, batch.token_request,
                                           batch.positions)
        acc = self.rule.start(batch.rows.shape[0], self.device) if hashed else None
        for layers in self.layer_runs(batch.tokens.shape[0]):
            inputs = self.weights.step_inputs(batch.tokens, batch.positions, batch.rows, layers)
            per_layer = [inputs.of(layer) for layer in layers]
            for layer, layer_inputs in zip(layers, per_layer):
                update(layer, batch, layer_inputs)
                write_mla_rows(self.pool.mla(layer), blocks, offsets, layer_inputs.mla)
            if hashed:
                for layer, layer_inputs in zip(layers, per_layer):
                    acc = self.family.chain(acc, layer, batch, self.rule, layer_inputs)
        return self._combine(acc) if hashed else None

    def layer_runs(self, num_tokens: int) -> list[range]:
        """Consecutive runs of layers whose inputs for ``num_tokens`` tokens a hoisted forward computes at once:
        at most ``HOIST_TOKEN_LAYERS`` token-layers a run, and at least one layer."""
        per_run = max(1, HOIST_TOKEN_LAYERS // max(num_tokens, 1))
        layers = self.config.num_layers
        return [range(first, min(first + per_run, layers)) for first in range(0, layers, per_run)]

    def _combine(self, acc: torch.Tensor) -> torch.Tensor:
        """The chained hash of every row from this engine's part of it (one engine holds all of it).

        # acc: [Q] int64 in [0, P) -> [Q] int64 in [0, P)
        """
        return acc

    def _blocks_needed(self, tokens: int) -> int:
        """Blocks this engine's pool holds a request of ``tokens`` tokens in."""
        return self.pool.config.blocks_for_tokens(tokens)

    def _write(self, batch: ForwardBatch, update) -> None:
        for layer in range(self.config.num_layers):
            update(layer, batch)
            write_mla(self.pool, layer, batch.block_table, batch.token_request, batch.positions,
                      self.weights.mla_bytes(layer, batch.tokens, batch.positions))

    @_on_pool_device
    def prefill(self, jobs: Sequence[PrefillJob]) -> list[int | None]:
        """Run one chunk of each job's prompt (whole prompts by default) into its blocks and ring, all in
        one forward; returns each prompt's first output token for the chunks that end their prompt, None
        for the others, once every byte it wrote has landed (one host synchronisation on CUDA). Chunked and
        whole prefill write the same bytes (DESIGN section 2). ValueError for
        a token outside the vocabulary, a chunk outside its prompt, or too few blocks."""
        for job in jobs:
            if not 0 <= job.start < job.stop <= len(job.prompt):
                check_prompt(job.prompt, vocab_size=self.config.vocab_size)  # an empty prompt says so
                raise ValueError(f"chunk [{job.start}, {job.stop}) is empty or outside its {len(job.prompt)}-token "
                                 "prompt")
            check_prompt(job.prompt[job.start:job.stop], vocab_size=self.config.vocab_size)  # each chunk its own
            need = self.pool.config.blocks_for_tokens(job.stop)
            if len(job.block_ids) < need:
                raise ValueError(f"a chunk ending at position {job.stop} needs {need} blocks, got {len(job.block_ids)}")
        mrope = [check_mrope_positions(j.mrope_positions, prompt_len=len(j.prompt), cache=self.config.cache)
                 for j in jobs]
        chunks: list[Chunk] = [(list(j.prompt[j.start:j.stop]), j.start, list(j.block_ids), j.ring_id) for j in jobs]
        finals = [b for b, j in enumerate(jobs) if j.last]
        hashes = self._prefill_hashes(chunks, finals, [torch.tensor(p[j.start:j.stop], dtype=torch.int64) if p else None
                                                       for p, j in zip(mrope, jobs)])
        if not finals and self.device.type == "cuda":
            # the caller may hand the chunks' blocks to another process (a pipelined pull) once this returns
            torch.cuda.current_stream(self.device).synchronize()
        last_tokens = [jobs[b].prompt[-1] for b in finals]
        tokens = iter(self.rule.next_tokens(hashes, last_tokens))
        return [next(tokens) if j.last else None for j in jobs]

    def _prefill_hashes(self, chunks: Sequence[Chunk], finals: Sequence[int],
                        mrope: Sequence[torch.Tensor | None] = ()) -> list[int]:
        """Write the chunks' cache entries; the hash of each final chunk's last token (``finals``: their indices).
        Replayed from a prefill graph where one serves the step (kpool: no MRoPE positions); else the hoisted forward
        (kpool on CUDA) or the per-layer one. ``mrope``: each chunk's MRoPE positions (``[n, 3]`` int64, None: text)."""
        if self.prefill_graphs is not None:
            hashes = self.prefill_graphs.run(chunks, hashed=bool(finals))
            if hashes is not None:
                return [hashes[b] for b in finals]
        batch = build_batch(chunks, last_only=True, device=self.device, mrope_positions=mrope or None)
        if len(finals) < len(chunks):
            batch = dataclasses.replace(batch, rows=batch.rows[torch.tensor(finals, dtype=torch.int64,
                                                                            device=self.device)])
        if self.hoists:
            hashes = self._hoisted_forward(batch, self.family.prefill, hashed=bool(finals))
            return hashes.tolist() if finals else []
        self._write(batch, self.family.prefill)
        return self._hashes(batch).tolist() if finals else []

    @_on_pool_device
    def decode_step(self, sequences: Sequence[DecodeSequence]) -> list[list[int]]:
        """One step for every unfinished sequence; updates them in place and returns the tokens
        each emitted (at least one for every sequence that was not finished)."""
        live = [s for s in sequences if not s.finished]
        if not live:
            return [[] for _ in sequences]
        graphed = self.graphs is not None and self.graphs.serves(len(live))
        num_spec = self.config.cache.num_spec
        chunks, drafts = [], []
        for seq in live:
            count = min(num_spec, seq.remaining - 1)
            need = self._blocks_needed(seq.cached + 1 + count)
            if len(seq.block_ids) < need:
                raise ValueError(f"request {seq.request_id}: a step to position {seq.cached + count} needs {need} "
                                 f"blocks, got {len(seq.block_ids)}")
            # a graphed step gives every request num_spec drafts; those past ``count`` are written past the
            # committed length (as a rejected draft is) and never accepted
            proposed = self.rule.drafts(seq.pending, num_spec if graphed else count)
            drafts.append(proposed[:count])
            chunks.append(([seq.pending, *proposed], seq.cached, seq.block_ids, seq.ring_id))
        deltas = [seq.mrope_delta for seq in live]
        if graphed:
            hashes = self.graphs.run(chunks, deltas if any(deltas) else None)
        else:
            mrope = [torch.arange(start, start + len(ids))[:, None].expand(-1, 3) + delta if delta else None
                     for (ids, start, *_), delta in zip(chunks, deltas)]
            hashes = self._decode_forward(build_batch(chunks, last_only=False, device=self.device,
                                                      mrope_positions=mrope)).tolist()
        targets = self.rule.next_tokens(hashes, [t for ids, *_ in chunks for t in ids])
        emitted_by_id: dict[int, list[int]] = {}
        cursor = 0
        for seq, proposed, (ids, *_) in zip(live, drafts, chunks):
            step_targets = targets[cursor:cursor + len(ids)]
            cursor += len(ids)
            accepted = 0
            while accepted < len(proposed) and proposed[accepted] == step_targets[accepted]:
                accepted += 1
            emitted = proposed[:accepted] + [step_targets[accepted]]
            seq.output.extend(emitted)
            seq.steps += 1
            seq.drafts_proposed += len(proposed)
            seq.drafts_accepted += accepted
            emitted_by_id[id(seq)] = emitted
        return [emitted_by_id.get(id(s), []) for s in sequences]

    # state ------------------------------------------------------------------------------
    @_on_pool_device
    def state_digest(self, block_ids: Sequence[int], ring_id: int, length: int) -> str:
        """sha256 over a request's compressed entries (every complete pool or group, pool order,
        layer by layer), then its ring's open pool (position order, layer by layer), then the MLA
        bytes of positions [0, length) (layer by layer), read from this pool: gathered on the device and
        read back at once (one host synchronisation).

        Only reads the request's blocks and ring, so it may run on another thread beside a step that does not
        write them (the decode daemon digests finished requests while the next steps run)."""
        table = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        stacks = self.family.stacks
        parts = [self.family.entries(table, length), request_ring_rows(stacks, ring_id, length).reshape(-1),
                 request_mla_rows(stacks, table, length).reshape(-1)]
        return hashlib.sha256(torch.cat(parts).cpu().numpy()).hexdigest()
