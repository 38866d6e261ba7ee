"""Triton QSA forward update in one launch: one program per request compresses the groups its chunk completes,
then writes its own ring rows (``UpdateGrid.REQUESTS``, the default of a decode step; see ``launch.py``).

The ring rows of a request are its own (``ring_blocks[b]``, one ring per request), so no other program reads
or writes them: ordering a request's ring reads before its ring writes is a matter inside one program, where
``triton.py``'s two launches order every read of the forward before every write. (An earlier single launch, one
grid over the work items writing the ring beside them, left a straddling group's older keys to whichever
program came first; this one has no such race.)

A program, for request b with tokens ``[q0, q1)`` at positions ``[start, seq)``:

1. loads the ring write's rows first (the slots of its last C tokens, head 0's key bits, the packed positions),
   so that their loads are in flight with the compression's; they are stored last;
2. compresses its groups (``groups.compress_groups``), BLOCK_W a tile: the first tile straight-line code, more
   only in a loop (a chunk longer than a tile: never in a decode step whose tile covers its longest request);
3. a barrier, only when the request's ring writes can meet its ring reads: the reads are the rows of positions
   ``(start // r) * r`` to ``start``, and a written position shares a row with one of them only when it lies C or
   more positions after it, i.e. when ``seq - 1 - (start // r) * r >= C``, which no decode step of at most
   ``num_spec`` drafts reaches (``C >= r + num_spec``); a longer chunk takes it;
4. stores the ring rows (``qsa_ring.triton.store_ring_head``), every head.

Keys, positions and ring are read through two views each: int16 (and int64 positions) for the compression, the
ring write's widest unit (``ring_units``) for the byte moves. No host synchronisation: the launch can be captured
in a CUDA graph. A request with no tokens does nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_pd.kernels.dispatch import interpreting
from kpool_pd.kernels.qsa_compress.triton import inv_freq_table, rope_cache_args, rope_pairs_fit
from kpool_pd.kernels.qsa_metadata.ref import QsaMetadata
from kpool_pd.kernels.qsa_ring.triton import ring_units, store_ring_head
from kpool_pd.kernels.qsa_rope.cache import RopeCache
from kpool_pd.kernels.qsa_update.groups import compress_groups
from kpool_pd.kernels.qsa_update.launch import UpdateLaunch
from kpool_pd.kernels.triton_helpers import gdc_launch_dependents, gdc_wait, launch_options


@triton.jit
def _update_per_request_kernel(
    keys_ptr, pos_ptr, qsl_ptr, seq_ptr, rings_ptr, comp_slot_ptr, ring_slot_ptr, ring_ptr, comp_ptr, w_ptr,
    inv_freq_ptr, table_ptr, table_rows, unit_ring_ptr, unit_keys_ptr, unit_pos_ptr, heads, key_tok_stride,
    key_head_stride, ring_stride, slot_stride, ring_head_stride, comp_block_stride, comp_row_stride, comp_head_stride,
    total_rows, total_ring_rows, unit_ring_stride, unit_slot_stride, unit_head_stride, unit_key_tok_stride,
    unit_key_head_stride, eps,
    ROWS_PER_BLOCK: tl.constexpr, CAP: tl.constexpr, CAP_P2: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
    D_P2: tl.constexpr, LOG_D: tl.constexpr, ROT: tl.constexpr, PAIRED: tl.constexpr, S1: tl.constexpr,
    S2: tl.constexpr, OFF: tl.constexpr, ROPE_CACHED: tl.constexpr, FP8: tl.constexpr, BLOCK_W: tl.constexpr,
    PRECISE: tl.constexpr, TABLE: tl.constexpr, UNIT_D: tl.constexpr, UNIT_D_P2: tl.constexpr, ZEROS: tl.constexpr,
    ZEROS_P2: tl.constexpr, UNIT_OFF: tl.constexpr, P: tl.constexpr, P_P2: tl.constexpr, PDL: tl.constexpr,
):
    # keys: [T, H, D] int16; positions: [T, 3] int64; ring: [N, C, H, W] int16 (the compression's views)
    # unit_ring, unit_keys, unit_positions: the same tensors in the ring write's unit (sizes and strides unit_*)
    # slots: [T] int64 (compressed, ring); compressed: [num_blocks, ROWS, H, D] int16 | uint8 (strides comp_*)
    # table: [table_rows, ROT] fp32 (the RopeCache, with TABLE)
    if PDL:  # launched before the previous kernel ends: wait for its writes; let the next kernel launch early
        gdc_wait()
        gdc_launch_dependents()
    req = tl.program_id(0)
    q0 = tl.load(qsl_ptr + req).to(tl.int64)
    q1 = tl.load(qsl_ptr + req + 1).to(tl.int64)
    seq = tl.load(seq_ptr + req).to(tl.int64)
    ring_row0 = tl.load(rings_ptr + req).to(tl.int64) * ring_stride
    start = seq - (q1 - q0)

    # 1. The ring write's rows: the request's last CAP tokens (those the metadata can give a slot), loaded now.
    entry = tl.arange(0, CAP_P2)
    tok = q1 - CAP + entry
    stash = (entry < CAP) & (tok >= q0)
    ring_slot = tl.load(ring_slot_ptr + tok, mask=stash, other=-1)
    unit_cols = tl.arange(0, UNIT_D_P2)
    key_mask = stash[:, None] & (unit_cols < UNIT_D)[None, :]
    key0 = tl.load(unit_keys_ptr + (tok * unit_key_tok_stride)[:, None] + unit_cols[None, :], mask=key_mask)
    p = tl.arange(0, P_P2)
    if ROPE_CACHED:
        packed = tl.load(unit_pos_ptr + tok[:, None] * P + p[None, :], mask=stash[:, None] & (p < P)[None, :])
    else:
        packed = tl.zeros((CAP_P2, P_P2), tl.int16)  # not stored without positions

    # 2. The groups the chunk completes, BLOCK_W a tile (reads the ring rows of positions first_group_pos..start).
    first_group_pos = (start // R) * R
    groups = (seq // R - start // R).to(tl.int32)
    index = tl.arange(0, BLOCK_W).to(tl.int64)
    compress_groups(keys_ptr, pos_ptr, ring_ptr, comp_slot_ptr, comp_ptr, w_ptr, inv_freq_ptr, table_ptr, table_rows,
                    q0, start, ring_row0, index, index < groups, heads, key_tok_stride, key_head_stride, slot_stride,
                    ring_head_stride, comp_block_stride, comp_row_stride, comp_head_stride, total_rows, eps,
                    ROWS_PER_BLOCK, CAP, R, D, D_P2, LOG_D, ROT, PAIRED, S1, S2, OFF, ROPE_CACHED, FP8, BLOCK_W,
                    PRECISE, TABLE)
    for first in range(BLOCK_W, groups, BLOCK_W):  # a chunk of more groups than a tile
        compress_groups(keys_ptr, pos_ptr, ring_ptr, comp_slot_ptr, comp_ptr, w_ptr, inv_freq_ptr, table_ptr,
                        table_rows, q0, start, ring_row0, first + index, first + index < groups, heads, key_tok_stride,
                        key_head_stride, slot_stride, ring_head_stride, comp_block_stride, comp_row_stride,
                        comp_head_stride, total_rows, eps, ROWS_PER_BLOCK, CAP, R, D, D_P2, LOG_D, ROT, PAIRED, S1, S2,
                        OFF, ROPE_CACHED, FP8, BLOCK_W, PRECISE, TABLE)

    # 3. A written position shares a ring row with a read one only if it lies CAP or more positions after it.
    if seq - 1 - first_group_pos >= CAP:
        tl.debug_barrier()  # every ring read above precedes the ring writes below

    # 4. The ring rows, every head (head 0's key bits loaded in step 1).
    write = stash & (ring_slot >= 0) & (ring_slot < total_ring_rows)
    dst = (ring_slot // CAP) * unit_ring_stride + (ring_slot % CAP) * unit_slot_stride
    store_ring_head(unit_ring_ptr, dst, key0, packed, write, UNIT_D, UNIT_D_P2, ZEROS, ZEROS_P2, UNIT_OFF, P, P_P2,
                    ROPE_CACHED)
    for h in range(1, heads):
        value = tl.load(unit_keys_ptr + (tok * unit_key_tok_stride + h * unit_key_head_stride)[:, None]
                        + unit_cols[None, :], mask=key_mask)
        store_ring_head(unit_ring_ptr, dst + h * unit_head_stride, value, packed, write, UNIT_D, UNIT_D_P2, ZEROS,
                        ZEROS_P2, UNIT_OFF, P, P_P2, ROPE_CACHED)


def update_per_request_triton(
    keys: torch.Tensor, positions: torch.Tensor, metadata: QsaMetadata, ring: torch.Tensor, compressed: torch.Tensor,
    norm_weight: torch.Tensor, *, eps: float, rotary_dim: int, theta: float, section: tuple[int, int, int],
    cache_rope_positions: bool, rope_cache: RopeCache | None, launch: UpdateLaunch, pdl: bool,
) -> None:
    """The one-launch update (``launch.grid`` REQUESTS; ``pdl`` already checked against the GPU).

    # keys: [T, H, D] bf16 (T, H > 0); positions: [T, 3] int64; ring: [num_rings, C, H, W] bf16 (in place);
    # compressed: [num_blocks, rows, H, D] bf16 | fp8_e4m3 (in place, dims contiguous); norm_weight: [D] fp32
    """
    requests = metadata.num_requests
    if requests == 0:  # every token is padding: nothing to compress, no ring slot
        return
    num_rings, capacity, heads, _ = ring.shape
    head_size = keys.shape[2]
    ring_slots = metadata.ring_slot_mapping
    assert ring_slots.is_contiguous() and metadata.compressed_slot_mapping.is_contiguous()
    units = ring_units(ring, keys, positions if cache_rope_positions else None)
    unit = units.constants()
    positions = positions.contiguous()
    fp8 = compressed.dtype == torch.float8_e4m3fn
    d_p2 = triton.next_power_of_2(head_size)
    inv_freq = inv_freq_table(rotary_dim, theta, keys.device)
    _update_per_request_kernel[(requests,)](
        keys.view(torch.int16), positions, metadata.query_start_loc, metadata.seq_lens, metadata.ring_blocks,
        metadata.compressed_slot_mapping, ring_slots, ring.view(torch.int16),
        compressed.view(torch.uint8 if fp8 else torch.int16), norm_weight.contiguous(), inv_freq,
        *rope_cache_args(rope_cache, inv_freq), units.ring, units.keys,
        units.positions if units.positions is not None else ring_slots, heads, keys.stride(0), keys.stride(1),
        ring.stride(0), ring.stride(1), ring.stride(2), compressed.stride(0), compressed.stride(1),
        compressed.stride(2), compressed.shape[0] * metadata.rows_per_block, num_rings * capacity, *units.strides(),
        float(eps),
        ROWS_PER_BLOCK=metadata.rows_per_block, CAP=capacity, CAP_P2=triton.next_power_of_2(capacity),
        R=metadata.compress_ratio, D=head_size, D_P2=d_p2, LOG_D=d_p2.bit_length() - 1, ROT=rotary_dim,
        PAIRED=launch.paired and rope_pairs_fit(rotary_dim, head_size), S1=section[1], S2=section[2],
        OFF=ring.shape[3] - 12 if cache_rope_positions else 0, ROPE_CACHED=cache_rope_positions, FP8=fp8,
        BLOCK_W=launch.block, PRECISE=not interpreting(), TABLE=rope_cache is not None, UNIT_D=unit["D"],
        UNIT_D_P2=unit["D_P2"], ZEROS=unit["ZEROS"], ZEROS_P2=unit["ZEROS_P2"], UNIT_OFF=unit["OFF"], P=unit["P"],
        P_P2=unit["P_P2"], PDL=pdl, num_warps=launch.num_warps, **launch_options(),
        **({"launch_pdl": True} if pdl else {}),
    )
