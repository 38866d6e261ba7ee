"""Triton QSA forward update: compress every group the forward completes, then write the ring rows.

Two grids (``launch.py``'s ``UpdateGrid``; a decode step takes the first by default):

- one launch, a program per request, which writes its own ring rows after its own ring reads
  (``per_request.py``);
- two launches on one stream (here), in this order, so every ring read of the first precedes every ring
  write of the second (the straddling group's older keys, and its first position, can live in rows that
  this forward's last C tokens overwrite; see ``ref.py``):

  1. grid over ``k_work`` (its static size ``max_work``; items past ``num_work``, read on the device
     together with the items, do nothing): each program compresses BLOCK_W groups (``groups.py``);
  2. the ring write of ``kpool_pd.kernels.qsa_ring`` over ``ring_slot_mapping``: over every token while the
     forward has at most requests x C of them, else over each request's last C tokens alone (the only ones
     the metadata gives a slot: a prefill's other tokens need no program).

  Both launch with programmatic dependent launch where the GPU has it (``pdl_available``): each waits
  for the previous kernel before its first read, and lets the next one launch early, so the ring write's
  launch overlaps the compression (its writes still follow every read of the compression).

(A single launch over the work items that wrote the ring rows beside the compression, leaving the few rows
that a straddling group reads to that group's program, was measured on the H200 and was not faster: 20.8 us
against 23.3 us for a decode step after an L2 flush, and slower for prefill, 321 us against 199 us.)

No host synchronisation, no launch per request from the host: the update can be captured in a CUDA graph. A
group whose slot is -1 or past the cache (only CUDA-built metadata can hold such) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_pd.kernels.dispatch import interpreting
from kpool_pd.kernels.qsa_compress.triton import inv_freq_table, rope_cache_args, rope_pairs_fit
from kpool_pd.kernels.qsa_metadata.ref import QsaMetadata
from kpool_pd.kernels.qsa_ring.triton import write_qsa_ring_triton
from kpool_pd.kernels.qsa_rope.cache import RopeCache
from kpool_pd.kernels.qsa_update.groups import compress_groups
from kpool_pd.kernels.qsa_update.launch import UpdateGrid, UpdateLaunch, default_update_launch
from kpool_pd.kernels.qsa_update.per_request import update_per_request_triton
from kpool_pd.kernels.triton_helpers import gdc_launch_dependents, gdc_wait, launch_options, pdl_available


@triton.jit
def _update_compress_kernel(
    keys_ptr, pos_ptr, qsl_ptr, seq_ptr, rings_ptr, work_ptr, num_work_ptr, comp_slot_ptr, ring_ptr, comp_ptr,
    w_ptr, inv_freq_ptr, table_ptr, table_rows, heads, max_work, key_tok_stride, key_head_stride, ring_stride,
    slot_stride, ring_head_stride, comp_block_stride, comp_row_stride, comp_head_stride, total_rows, eps,
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
    compress_groups(keys_ptr, pos_ptr, ring_ptr, comp_slot_ptr, comp_ptr, w_ptr, inv_freq_ptr, table_ptr, table_rows,
                     q0, seq - q_len, ring_row0, index, live, heads, key_tok_stride, key_head_stride, slot_stride,
                     ring_head_stride, comp_block_stride, comp_row_stride, comp_head_stride, total_rows, eps,
                     ROWS_PER_BLOCK, CAP, R, D, D_P2, LOG_D, ROT, PAIRED, S1, S2, OFF, ROPE_CACHED, FP8, BLOCK_W,
                     PRECISE, TABLE)


def qsa_forward_update_triton(
    keys: torch.Tensor, positions: torch.Tensor, metadata: QsaMetadata, ring: torch.Tensor, compressed: torch.Tensor,
    norm_weight: torch.Tensor, *, eps: float, rotary_dim: int, theta: float, section: tuple[int, int, int],
    cache_rope_positions: bool, rope_cache: RopeCache | None = None, launch: UpdateLaunch | None = None,
) -> None:
    """``launch``: the grid and its options (``kpool_pd.kernels.qsa_update.launch``); None takes
    ``default_update_launch`` (one launch a decode step, two a prefill forward). Every launch writes the same bytes.

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
        launch = default_update_launch(metadata=metadata, device=keys.device)
    pdl = launch.pdl and keys.is_cuda and pdl_available()
    if launch.grid is UpdateGrid.REQUESTS:
        update_per_request_triton(keys, positions, metadata, ring, compressed, norm_weight, eps=eps,
                                  rotary_dim=rotary_dim, theta=theta, section=section,
                                  cache_rope_positions=cache_rope_positions, rope_cache=rope_cache, launch=launch,
                                  pdl=pdl)
        return
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
