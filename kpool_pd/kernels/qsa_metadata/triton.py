"""Triton QSA metadata builder: every output of one forward in one launch, no host synchronisation.

One program per request. Each program sums every request's completed groups (its own prefix and
the total; B values, read in tiles), writes its tokens' maps, its ``k_work`` items at its prefix,
and a share of the -1 padding of ``k_work``; program 0 writes ``num_work``. Output sizes come from
``num_tokens`` and the shapes only, so the launch can be captured in a CUDA graph. Tokens at or
past ``query_start_loc[B]`` (a caller's padding up to ``num_tokens``) get request -1, position -1,
no visible rows and no slots.

Nothing here reads values on the host: on CUDA a request whose table holds -1 where a group closes
gets compressed slot -1 (the forward update then skips that group); the CPU checks reject it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_pd.kernels.qsa_metadata.ref import QsaMetadata, max_work_items, metadata_outputs


@triton.jit
def _metadata_kernel(qsl_ptr, seq_ptr, table_ptr, rings_ptr, req_ptr, pos_ptr, visible_ptr, ring_slot_ptr,
                     comp_slot_ptr, work_ptr, num_work_ptr, requests, tokens, table_stride, table_width, max_work,
                     cap, block_size, R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    # qsl: [B + 1] int32; seq: [B] int32; table: [B, M] int32; rings: [B] int32
    b = tl.program_id(0)
    rows = block_size // R
    before = 0
    total = 0
    for c in range(0, requests, BLOCK_B):
        idx = c + tl.arange(0, BLOCK_B)
        m = idx < requests
        q0 = tl.load(qsl_ptr + idx, mask=m, other=0)
        q1 = tl.load(qsl_ptr + idx + 1, mask=m, other=0)
        s = tl.load(seq_ptr + idx, mask=m, other=0)
        done = tl.where(m, s // R - (s - (q1 - q0)) // R, 0)
        total += tl.sum(done, axis=0)
        before += tl.sum(tl.where(idx < b, done, 0), axis=0)
    if b == 0:
        tl.store(num_work_ptr, total)

    q0 = tl.load(qsl_ptr + b).to(tl.int64)
    q_len = tl.load(qsl_ptr + b + 1).to(tl.int64) - q0
    seq = tl.load(seq_ptr + b).to(tl.int64)
    start = seq - q_len
    ring = tl.load(rings_ptr + b).to(tl.int64)
    for t in range(0, q_len, BLOCK_T):
        i = t + tl.arange(0, BLOCK_T)
        m = i < q_len
        pos = start + i
        tok = q0 + i
        tl.store(req_ptr + tok, tl.zeros((BLOCK_T,), tl.int32) + b, mask=m)
        tl.store(pos_ptr + tok, pos, mask=m)
        tl.store(visible_ptr + tok, tl.minimum((pos + 1) // R, seq // R).to(tl.int32), mask=m)
        tl.store(ring_slot_ptr + tok, tl.where(i >= q_len - cap, ring * cap + pos % cap, -1), mask=m)
        group = pos // R
        completes = ((pos + 1) % R) == 0
        column = group * R // block_size
        block = tl.load(table_ptr + b * table_stride + column, mask=m & completes & (column < table_width),
                        other=-1).to(tl.int64)
        tl.store(comp_slot_ptr + tok, tl.where(completes & (block >= 0), block * rows + group % rows, -1), mask=m)

    done = seq // R - start // R
    for j in range(0, done, BLOCK_T):
        g = j + tl.arange(0, BLOCK_T)
        m = (g < done) & (before + g < max_work)
        item = before + g
        tl.store(work_ptr + item * 2, tl.zeros((BLOCK_T,), tl.int32) + b, mask=m)
        tl.store(work_ptr + item * 2 + 1, g.to(tl.int32), mask=m)
    for c in range(total + b * BLOCK_T, max_work, requests * BLOCK_T):
        item = c + tl.arange(0, BLOCK_T)
        m = item < max_work
        tl.store(work_ptr + item * 2, tl.full((BLOCK_T,), -1, tl.int32), mask=m)
        tl.store(work_ptr + item * 2 + 1, tl.full((BLOCK_T,), -1, tl.int32), mask=m)

    if b == requests - 1:  # tokens past the last request: the caller's padding
        for t in range(tl.load(qsl_ptr + requests).to(tl.int64), tokens, BLOCK_T):
            tok = t + tl.arange(0, BLOCK_T)
            m = tok < tokens
            tl.store(req_ptr + tok, tl.full((BLOCK_T,), -1, tl.int32), mask=m)
            tl.store(pos_ptr + tok, tl.full((BLOCK_T,), -1, tl.int64), mask=m)
            tl.store(visible_ptr + tok, tl.zeros((BLOCK_T,), tl.int32), mask=m)
            tl.store(ring_slot_ptr + tok, tl.full((BLOCK_T,), -1, tl.int64), mask=m)
            tl.store(comp_slot_ptr + tok, tl.full((BLOCK_T,), -1, tl.int64), mask=m)


def build_qsa_metadata_triton(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, ring_blocks: torch.Tensor, *,
    compress_ratio: int, ring_capacity: int, block_size: int, num_tokens: int,
    out: dict[str, torch.Tensor] | None = None,
) -> QsaMetadata:
    # query_start_loc: [B + 1] int32; seq_lens: [B] int32; block_table: [B, M] int32; ring_blocks: [B] int32
    """``out``: the output tensors to write (``metadata_outputs``' names and shapes), e.g. views of a
    builder's preallocated buffers; allocated here when omitted."""
    requests = seq_lens.shape[0]
    max_work = max_work_items(num_tokens, requests, compress_ratio)
    if out is None:
        out = metadata_outputs(num_tokens, max_work, seq_lens.device)
    elif not requests:
        out["num_work"].zero_()  # no program runs to write it
    if requests:
        assert block_table.stride(1) == 1, "block table rows must be contiguous"
        _metadata_kernel[(requests,)](
            query_start_loc, seq_lens, block_table, ring_blocks, out["token_to_req"], out["logical_positions"],
            out["visible_blocks"], out["ring_slot_mapping"], out["compressed_slot_mapping"], out["k_work"],
            out["num_work"], requests, num_tokens, block_table.stride(0), block_table.shape[1], max_work,
            ring_capacity, block_size, R=compress_ratio, BLOCK_B=256 if seq_lens.is_cuda else 16,
            BLOCK_T=64 if seq_lens.is_cuda else 16, num_warps=4,
        )
    return QsaMetadata(
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table, ring_blocks=ring_blocks,
        compress_ratio=compress_ratio, ring_capacity=ring_capacity, block_size=block_size, **out,
    )

