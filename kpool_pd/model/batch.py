"""One forward's batch: packed tokens of several requests, their block tables and rings."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kpool_pd.kernels.kpool_prefill import prefill_pool_offsets


@dataclass(frozen=True, kw_only=True, eq=False)
class ForwardBatch:
    """B requests, each contributing consecutive positions ``start_pos[b] ..`` (a prefill chunk, from 0
    for a whole prompt, or a decode step: the last committed token and its drafts). ``rows`` picks the tokens whose
    next token is asked for (prefill: each prompt's last token; decode: every token). The per-row views
    (``row_request``, ``row_seq_lens``, ``row_block_table``) are computed once per batch, on first use: every
    layer reads them, and the batch's tensors are not changed after it is built.

    # tokens, positions: [T] int64; query_start_loc: [B+1] int32; start_pos, seq_lens: [B] int32
    # block_table: [B, M] int32 (-1 padded); ring_ids: [B] int32; rows: [Q] int64 indices into tokens
    # token_request: [T] int64, the request of each token
    # query_start_loc_cpu: [B+1] int32, seq_lens_cpu: [B] int32 on the host, or None (the batch's host copies, for a
    #   metadata builder's host counts without a device read)
    # mrope_positions: [T, 3] int64 (time, height, width) or None: text, every axis the token's position
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    start_pos: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    ring_ids: torch.Tensor
    rows: torch.Tensor
    token_request: torch.Tensor
    from_zero: bool = False  # every request starts at position 0 (whole prompts), known without reading start_pos
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None
    _pool_offsets: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    def pool_offsets(self, kpool: int) -> torch.Tensor:
        """Where each request's completed pools of ``kpool`` tokens start among the batch's
        (``kpool_pd.kernels.kpool_prefill.prefill_pool_offsets``), computed once for every layer.

        # -> [B+1] int64
        """
        if kpool not in self._pool_offsets:
            self._pool_offsets[kpool] = prefill_pool_offsets(self.query_start_loc,
                                                             None if self.from_zero else self.start_pos, kpool)
        return self._pool_offsets[kpool]

    @functools.cached_property
    def row_request(self) -> torch.Tensor:
        """# -> [Q] int64: the request of each row (a row past the last request's tokens, a graph's padding that
        belongs to no request, reads the last request, which is then padding too)."""
        starts = self.query_start_loc.to(torch.int64)
        return torch.searchsorted(starts[1:], self.rows, right=True).clamp_(max=self.num_requests - 1)

    @functools.cached_property
    def row_seq_lens(self) -> torch.Tensor:
        """# -> [Q] int32: tokens visible to each row (its position + 1)."""
        return (self.positions[self.rows] + 1).to(torch.int32)

    @functools.cached_property
    def row_block_table(self) -> torch.Tensor:
        """# -> [Q, M] int32"""
        return self.block_table[self.row_request]

    @functools.cached_property
    def row_ring_ids(self) -> torch.Tensor:
        """# -> [Q] int32: the ring of each row's request"""
        return self.ring_ids[self.row_request]


def build_batch(chunks: Sequence[tuple[Sequence[int], int, Sequence[int], int]], *, last_only: bool,
                device: torch.device, mrope_positions: Sequence[torch.Tensor | None] | None = None) -> ForwardBatch:
    """``chunks``: per request (token ids, first position, block ids, ring id). ``mrope_positions``: per request its
    tokens' MRoPE positions (``[n, 3]`` int64, None: text), or None: every request text."""
    if not chunks:
        raise ValueError("a forward needs at least one request")
    tokens, positions, starts, first, lens = [], [], [0], [], []
    width = max(len(blocks) for _, _, blocks, _ in chunks)
    table = torch.full((len(chunks), max(width, 1)), -1, dtype=torch.int32)
    rows: list[int] = []
    token_request: list[int] = []
    for b, (ids, start, blocks, _) in enumerate(chunks):
        if not ids:
            raise ValueError(f"request {b} of the batch has no tokens")
        tokens.extend(ids)
        token_request.extend([b] * len(ids))
        positions.extend(range(start, start + len(ids)))
        if last_only:
            rows.append(starts[-1] + len(ids) - 1)
        else:
            rows.extend(range(starts[-1], starts[-1] + len(ids)))
        starts.append(starts[-1] + len(ids))
        first.append(start)
        lens.append(start + len(ids))
        table[b, :len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
    mrope = None
    if mrope_positions is not None and any(p is not None for p in mrope_positions):
        if len(mrope_positions) != len(chunks):
            raise ValueError(f"mrope_positions names {len(mrope_positions)} requests, the batch has {len(chunks)}")
        mrope = torch.cat([torch.arange(start, start + len(ids))[:, None].expand(-1, 3) if p is None else p
                           for (ids, start, *_), p in zip(chunks, mrope_positions)]).to(device)
        if mrope.shape != (len(tokens), 3):
            raise ValueError(f"mrope_positions hold {list(mrope.shape)} for {len(tokens)} tokens (want [tokens, 3])")
    as_long = dict(dtype=torch.int64, device=device)
    as_int = dict(dtype=torch.int32, device=device)
    return ForwardBatch(
        tokens=torch.tensor(tokens, **as_long), positions=torch.tensor(positions, **as_long),
        query_start_loc=torch.tensor(starts, **as_int), start_pos=torch.tensor(first, **as_int),
        seq_lens=torch.tensor(lens, **as_int), block_table=table.to(device),
        ring_ids=torch.tensor([ring for *_, ring in chunks], **as_int), rows=torch.tensor(rows, **as_long),
        token_request=torch.tensor(token_request, **as_long),
        from_zero=not any(first),
        query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32), seq_lens_cpu=torch.tensor(lens, dtype=torch.int32),
        mrope_positions=mrope,
    )
