"""Triton QSA forward update: compress every group the forward completes, then write the ring rows.

Two launches on one stream, in this order, so every ring read of the first precedes every ring
write of the second (the straddling group's older keys, and its first position, can live in rows
that this forward's last C tokens overwrite; see ``ref.py``):

1. grid over ``k_work`` (its static size ``max_work``; items past ``num_work``, read on the device
   together with the items, do nothing): each program compresses BLOCK_W groups, slot by slot from
   this forward's keys or, for positions before the chunk, from the request's ring; the group's first
   MRoPE position comes from ``positions``, the ring's packed positions, or ``(p, p, p)``; its cos/sin
   from the ``RopeCache`` where one is given and holds the position, else computed; the row goes to
   the slot that the group's last token carries in ``compressed_slot_mapping`` (launch options:
   ``launch.py``);
2. the ring write of ``kpool_pd.kernels.qsa_ring`` over ``ring_slot_mapping``: over every token while the
   forward has at most requests x C of them (a decode step), else over each request's last C tokens
   alone (the only ones the metadata gives a slot: a prefill's other tokens need no program).

Both launch with programmatic dependent launch where the GPU has it (``pdl_available``): each waits
for the previous kernel before its first read, and lets the next one launch early, so the ring write's
launch overlaps the compression (its writes still follow every read of the compression).

(A single launch that writes the ring rows beside the compression, leaving the few rows that a
straddling group reads to that group's program, was measured on the H200 and was not faster: 20.8 us
against 23.3 us for a decode step after an L2 flush, and slower for prefill, 321 us against 199 us.)

No host synchronisation, no per-request launch: the update can be captured in a CUDA graph. A
group whose slot is -1 or past the cache (only CUDA-built metadata can hold such) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_pd.kernels.dispatch import interpreting
from kpool_pd.kernels.qsa_compress.triton import (compress_tile, inv_freq_table, rope_cache_args, rope_cos_sin,
                                         rope_pairs_fit)
from kpool_pd.kernels.qsa_metadata.ref import QsaMetadata
from kpool_pd.kernels.qsa_ring.triton import write_qsa_ring_triton
from kpool_pd.kernels.qsa_update.launch import UpdateLaunch, default_update_launch
from kpool_pd.kernels.qsa_rope.cache import RopeCache
from kpool_pd.kernels.triton_helpers import (f32_to_bf16_bits, f32_to_e4m3_bits, gdc_launch_dependents, gdc_wait,
                                    launch_options, pdl_available)


@triton.jit
def _ring_position(ring_ptr, row, axis: tl.constexpr, live):
    """int64 MRoPE position ``axis`` packed at ring element offset ``row`` (4 int16 words, little end first)."""
    value = tl.zeros(row.shape, tl.int64)
    for k in tl.static_range(4):
        word = tl.load(ring_ptr + row + axis * 4 + k, mask=live, other=0)
        value = value | ((word.to(tl.int64) & 0xFFFF) << (16 * k))
    return value


@triton.jit
def _update_compress_kernel(
    keys_ptr, pos_ptr, qsl_ptr, seq_ptr, rings_ptr, work_ptr, num_work_ptr, comp_slot_ptr, ring_ptr, comp_ptr,
    w_ptr, inv_freq_ptr, table_ptr, table_rows, heads, max_work, key_tok_stride, key_head_stride, ring_stride, slot_stride, ring_head_stride,
    comp_block_stride, comp_row_stride, comp_head_stride, total_rows, eps,
    ROWS_PER_BLOCK: tl.constexpr, CAP: tl.constexpr, R: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr,
    LOG_D: tl.constexpr, ROT: tl.constexpr, PAIRED: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
    OFF: tl.constexpr, ROPE_CACHED: tl.constexpr, FP8: tl.constexpr, BLOCK_W: tl.constexpr, PRECISE: tl.constexpr,
    TABLE: tl.constexpr, PDL: tl.constexpr,
):
    # keys: [T, H, D] int16; positions: [T, 3] int64; work: [max_work, 2] int32; ring: [N, C, H, W] int16
    # compressed: [num_blocks, ROWS, H, D] int16 | uint8 (strides comp_*, dims contiguous)
    # table: [table_rows, ROT] fp32 (the RopeCache, with TABLE)
    if PDL:  # launched before the previous kernel ends: wait for its writes; let the ring write launch early
        gdc_wait()
        gdc_launch_dependents()
    items = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    in_list = items < max_work
    num_work = tl.load(num_work_ptr)
    req = tl.load(work_ptr + items * 2, mask=in_list, other=0).to(tl.int64)
    index = tl.load(work_ptr + items * 2 + 1, mask=in_list, other=0).to(tl.int64)
    live = in_list & (items < num_work)
    q0 = tl.load(qsl_ptr + req, mask=live, other=0).to(tl.int64)
    q_len = tl.load(qsl_ptr + req + 1, mask=live, other=0).to(tl.int64) - q0
    seq = tl.load(seq_ptr + req, mask=live, other=0).to(tl.int64)
    ring_row0 = tl.load(rings_ptr + req, mask=live, other=0).to(tl.int64) * ring_stride
    start = seq - q_len
    pos0 = (start // R + index) * R  # the group's first position
    tok0 = q0 + pos0 - start  # its token index in this forward (below q0 when it straddles)

    fresh = live & (pos0 >= start)
    safe_tok = tl.where(fresh, tok0, 0)
    first_t = tl.load(pos_ptr + safe_tok * 3, mask=fresh, other=0)
    first_h = tl.load(pos_ptr + safe_tok * 3 + 1, mask=fresh, other=0)
    first_w = tl.load(pos_ptr + safe_tok * 3 + 2, mask=fresh, other=0)
    old = live & (pos0 < start)
    if ROPE_CACHED:
        packed = tl.where(old, ring_row0 + (pos0 % CAP) * slot_stride + OFF, 0)
        first_t = tl.where(old, _ring_position(ring_ptr, packed, 0, old), first_t)
        first_h = tl.where(old, _ring_position(ring_ptr, packed, 1, old), first_h)
        first_w = tl.where(old, _ring_position(ring_ptr, packed, 2, old), first_w)
    else:
        first_t = tl.where(old, pos0, first_t)
        first_h = tl.where(old, pos0, first_h)
        first_w = tl.where(old, pos0, first_w)

    slot = tl.load(comp_slot_ptr + tl.where(live, tok0 + R - 1, 0), mask=live, other=-1)
    write = live & (slot >= 0) & (slot < total_rows)
    row_base = (slot // ROWS_PER_BLOCK) * comp_block_stride + (slot % ROWS_PER_BLOCK) * comp_row_stride
    cols = tl.arange(0, D_P2)
    mask = write[:, None] & (cols < D)[None, :]
    cos, sin = rope_cos_sin(inv_freq_ptr, table_ptr, table_rows, first_t, first_h, first_w, BLOCK_W, D_P2, ROT, S1, S2,
                            PAIRED, PRECISE, TABLE)
    for h in range(heads):
        y = compress_tile(keys_ptr, ring_ptr, w_ptr, tok0 * key_tok_stride + h * key_head_stride, key_tok_stride,
                          ring_row0 + h * ring_head_stride, slot_stride, pos0, start, CAP, cos, sin, live, eps,
                          BLOCK_W, R, D, D_P2, LOG_D, ROT, PAIRED, True)
        out = comp_ptr + (row_base + h * comp_head_stride)[:, None] + cols[None, :]
        if FP8:
            tl.store(out, f32_to_e4m3_bits(y), mask=mask)
        else:
            tl.store(out, f32_to_bf16_bits(y), mask=mask)


def qsa_forward_update_triton(
    keys: torch.Tensor, positions: torch.Tensor, metadata: QsaMetadata, ring: torch.Tensor, compressed: torch.Tensor,
    norm_weight: torch.Tensor, *, eps: float, rotary_dim: int, theta: float, section: tuple[int, int, int],
    cache_rope_positions: bool, rope_cache: RopeCache | None = None, launch: UpdateLaunch | None = None,
) -> None:
    """``launch``: the compression's launch options (``kpool_pd.kernels.qsa_update.launch``); None takes
    ``default_update_launch``. Every launch writes the same bytes.

    # keys: [T, H, D] bf16; positions: [T, 3] int64; ring: [num_rings, C, H, W] bf16 (in place);
    # compressed: [num_blocks, rows, H, D] bf16 | fp8_e4m3 (in place, any strides, dims contiguous)
    # norm_weight: [D] fp32; rope_cache: table [P, rotary_dim] fp32 on the keys' device, or None
    """
    num_tokens, heads, head_size = keys.shape
    if num_tokens == 0 or heads == 0:
        return
    max_work = metadata.k_work.shape[0]
    assert keys.stride(2) == 1 and ring.stride(3) == 1 and compressed.stride(3) == 1, "rows must be contiguous"
    assert metadata.k_work.is_contiguous() and metadata.compressed_slot_mapping.is_contiguous()
    if launch is None:
        launch = default_update_launch(max_work=max_work, device=keys.device)
    pdl = launch.pdl and keys.is_cuda and pdl_available()
    if max_work:
        fp8 = compressed.dtype == torch.float8_e4m3fn
        d_p2 = triton.next_power_of_2(head_size)
        inv_freq = inv_freq_table(rotary_dim, theta, keys.device)
        _update_compress_kernel[(triton.cdiv(max_work, launch.block),)](
            keys.view(torch.int16), positions.contiguous(), metadata.query_start_loc, metadata.seq_lens,
            metadata.ring_blocks, metadata.k_work, metadata.num_work, metadata.compressed_slot_mapping,
            ring.view(torch.int16), compressed.view(torch.uint8 if fp8 else torch.int16), norm_weight.contiguous(),
            inv_freq, *rope_cache_args(rope_cache, inv_freq), heads, max_work, keys.stride(0), keys.stride(1),
            ring.stride(0), ring.stride(1), ring.stride(2), compressed.stride(0), compressed.stride(1),
            compressed.stride(2), compressed.shape[0] * metadata.rows_per_block, float(eps),
            ROWS_PER_BLOCK=metadata.rows_per_block, CAP=metadata.ring_capacity, R=metadata.compress_ratio, D=head_size,
            D_P2=d_p2, LOG_D=d_p2.bit_length() - 1, ROT=rotary_dim,
            PAIRED=launch.paired and rope_pairs_fit(rotary_dim, head_size), S1=section[1], S2=section[2],
            OFF=ring.shape[3] - 12 if cache_rope_positions else 0, ROPE_CACHED=cache_rope_positions, FP8=fp8,
            BLOCK_W=launch.block, PRECISE=not interpreting(), TABLE=rope_cache is not None, PDL=pdl,
            num_warps=launch.num_warps, **launch_options(), **({"launch_pdl": True} if pdl else {}),
        )
    write_qsa_ring_triton(ring, keys, positions if cache_rope_positions else None, metadata.ring_slot_mapping,
                          pdl=pdl, query_start_loc=metadata.query_start_loc, after_update=max_work > 0)
