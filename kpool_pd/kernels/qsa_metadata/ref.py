"""Per-forward metadata of the QSA cache ops (plain torch).

A forward holds, for each request ``b``, ``q_len`` consecutive tokens ending at its
``seq_len``: the chunk ``[start, seq_len)`` with ``start = seq_len - q_len``. A prefill chunk
and a decode step (the last committed token plus drafts) look the same here. With
``r = compress_ratio``, ``C = ring_capacity`` and ``R = block_size / r`` rows per block:

* ``token_to_req[t]``, ``logical_positions[t]`` (``start + i`` for the chunk's i-th token);
* ``visible_blocks[t] = min((pos + 1) // r, seq_len // r)``: complete compressed rows that
  token ``t`` may attend to;
* ``ring_slot_mapping[t] = ring_blocks[b] * C + pos % C`` for the request's last ``C`` tokens
  of the forward, -1 for earlier ones (C consecutive positions never share a row, so no two
  tokens of one forward alias a ring row);
* ``compressed_slot_mapping[t] = block_table[b, g * r // block_size] * R + g % R`` with
  ``g = pos // r``, only for a token that completes its group (``(pos + 1) % r == 0``), else -1;
* ``k_work[w] = (b, g - start // r)``: every group completed by a token of this forward,
  ordered by request then group; the first of them may begin before ``start`` (it straddles
  the chunk boundary). ``k_work`` is padded with -1 to the static bound
  ``max_work = (T + (r - 1) * B) // r`` (a request's chunk completes at most
  ``(q_len + r - 1) // r`` groups); ``num_work[0]`` counts the real items.

A forward padded to ``num_tokens`` tokens (a CUDA graph's bucket) has tokens past
``query_start_loc[B]``: they belong to no request (request -1, position -1, no visible rows, no
slots) and ``k_work`` is padded to the bound of ``num_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kpool_pd.kernels.qsa_metadata.split import BatchSplit


@dataclass(frozen=True, kw_only=True, eq=False)
class QsaMetadata:
    """The metadata of one forward; every tensor lives on the device of the inputs."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, M] int32
    ring_blocks: torch.Tensor  # [B] int32
    token_to_req: torch.Tensor  # [T] int32
    logical_positions: torch.Tensor  # [T] int64
    visible_blocks: torch.Tensor  # [T] int32
    ring_slot_mapping: torch.Tensor  # [T] int64, -1 = no ring row
    compressed_slot_mapping: torch.Tensor  # [T] int64, -1 = completes no group
    k_work: torch.Tensor  # [max_work, 2] int32 (request, group index in the chunk), -1 padded
    num_work: torch.Tensor  # [1] int32
    compress_ratio: int
    ring_capacity: int
    block_size: int
    split: BatchSplit | None = None  # host counts; set by QsaMetadataBuilder, which has the batch's host copies

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.token_to_req.shape[0]

    @property
    def rows_per_block(self) -> int:
        return self.block_size // self.compress_ratio

    def __repr__(self) -> str:
        return (
            f"QsaMetadata(requests={self.num_requests}, tokens={self.num_tokens}, "
            f"max_work={self.k_work.shape[0]}, r={self.compress_ratio}, C={self.ring_capacity}, "
            f"block_size={self.block_size}, device={self.seq_lens.device})"
        )


def max_work_items(num_tokens: int, num_requests: int, compress_ratio: int) -> int:
    """Static bound on the groups one forward completes: (T + (r - 1) * B) // r."""
    return (num_tokens + (compress_ratio - 1) * num_requests) // compress_ratio


def metadata_outputs(num_tokens: int, max_work: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Fresh output tensors of one forward, by field name."""
    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    return dict(
        token_to_req=torch.empty(num_tokens, **i32), logical_positions=torch.empty(num_tokens, **i64),
        visible_blocks=torch.empty(num_tokens, **i32), ring_slot_mapping=torch.empty(num_tokens, **i64),
        compressed_slot_mapping=torch.empty(num_tokens, **i64), k_work=torch.empty(max_work, 2, **i32),
        num_work=torch.zeros(1, **i32),
    )


def build_qsa_metadata(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    ring_blocks: torch.Tensor,
    *,
    compress_ratio: int,
    ring_capacity: int,
    block_size: int,
    num_tokens: int | None = None,
) -> QsaMetadata:
    # query_start_loc: [B + 1] int32; seq_lens: [B] int32; block_table: [B, M] int32; ring_blocks: [B] int32
    """The metadata of one forward (see the module docstring), of ``num_tokens`` tokens (None: the real ones,
    ``query_start_loc[B]``; more: the rest are padding). The math alone: the public op
    (``kpool_pd.kernels.qsa_metadata``) checks the arguments (``kpool_pd.kernels.qsa_metadata.checks``) before calling it."""
    r, cap = compress_ratio, ring_capacity
    rows_per_block = block_size // r
    device = seq_lens.device
    num_requests = seq_lens.shape[0]
    real_tokens = int(query_start_loc[-1])
    num_tokens = real_tokens if num_tokens is None else num_tokens
    assert num_tokens >= real_tokens, (num_tokens, real_tokens)

    q_start = query_start_loc.to(torch.int64)
    q_lens = q_start[1:] - q_start[:-1]  # [B]
    seq = seq_lens.to(torch.int64)
    chunk_start = seq - q_lens  # [B] first position of each chunk

    req = torch.repeat_interleave(torch.arange(num_requests, device=device), q_lens, output_size=real_tokens)
    index_in_chunk = torch.arange(real_tokens, device=device) - q_start[req]
    pos = chunk_start[req] + index_in_chunk  # [T]
    req_seq = seq[req]

    visible = torch.minimum((pos + 1) // r, req_seq // r)

    in_ring_window = index_in_chunk >= q_lens[req] - cap
    ring_slot = torch.where(in_ring_window, ring_blocks.to(torch.int64)[req] * cap + pos % cap, -1)

    group = pos // r
    completes = (pos + 1) % r == 0
    block_col = (group * r) // block_size
    block_id = block_table.to(torch.int64)[req, block_col]
    compressed_slot = torch.where(completes, block_id * rows_per_block + group % rows_per_block, -1)

    # Groups completed in [start, seq_len): g from start // r to seq_len // r - 1.
    groups_done = seq // r - chunk_start // r  # [B]
    num_work = int(groups_done.sum())
    max_work = max_work_items(num_tokens, num_requests, r)
    assert num_work <= max_work, (num_work, max_work)
    work_req = torch.repeat_interleave(torch.arange(num_requests, device=device), groups_done, output_size=num_work)
    work_first = torch.cumsum(groups_done, 0) - groups_done  # [B] index of each request's first item
    work_group = torch.arange(num_work, device=device) - work_first[work_req]
    k_work = torch.full((max_work, 2), -1, dtype=torch.int32, device=device)
    k_work[:num_work, 0] = work_req.to(torch.int32)
    k_work[:num_work, 1] = work_group.to(torch.int32)

    padding = num_tokens - real_tokens  # tokens of no request: -1 everywhere, no visible rows

    def padded(values: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([values, torch.full((padding,), fill, dtype=values.dtype, device=device)])

    return QsaMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        ring_blocks=ring_blocks,
        token_to_req=padded(req.to(torch.int32), -1),
        logical_positions=padded(pos, -1),
        visible_blocks=padded(visible.to(torch.int32), 0),
        ring_slot_mapping=padded(ring_slot, -1),
        compressed_slot_mapping=padded(compressed_slot, -1),
        k_work=k_work,
        num_work=torch.tensor([num_work], dtype=torch.int32, device=device),
        compress_ratio=r,
        ring_capacity=cap,
        block_size=block_size,
    )
