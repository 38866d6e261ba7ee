"""Triton kernels of one layer's hash: the new chained hash of each row straight from its selection,
reading the cache bytes in place (no features tensor; ``ref.py`` says which bytes, in which order).

One program per query row walks its features in tiles: the selection (+1) and the selected entries
(kpool: fp8 codes and scale bytes; QSA: compressed key rows), the open pool's (group's) ring rows,
and the MLA bytes of every attended token, each byte times its weight, summed in int64. Every
product is below 2**39 and a tile's sum far below 2**63, so each partial sum is exact; the partial
sums are reduced modulo P as they go (all are non-negative), which gives the reference's value bit
for bit. Reads that name nothing (a pool or row -1, a block -1, a ring id -1, a position past the
row's length) are masked: they read no memory and count zero. Nothing depends on the host: the grid
is the row count, the loops' bounds are shapes, so the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kpool_pd.kernels.kpool_cache.triton import entry_offsets, page_strides
from kpool_pd.kvcache import FP8_ENTRY_BYTES, INDEX_HEAD_DIM
from kpool_pd.model.rule import HASH_PRIME, LAYER_MULTIPLIER

BLOCK_K = 16  # selected pools (rows) per tile
BLOCK_T = 16  # attended tokens per tile
BLOCK_B = 128  # bytes per tile row
PRIME = tl.constexpr(HASH_PRIME)
MULTIPLIER = tl.constexpr(LAYER_MULTIPLIER)
CODE_BYTES = tl.constexpr(INDEX_HEAD_DIM)
ENTRY_BYTES = tl.constexpr(FP8_ENTRY_BYTES)


@triton.jit
def _weighted_bytes(ptr, base, held, w_ptr, w_at, width, BLOCK_B: tl.constexpr):
    """sum over b < width of ptr[base + b] * w_ptr[w_at + b] for each held row, modulo P.

    # ptr: uint8; base, w_at: [T] int64; held: [T] bool -> [T] int64 in [0, P) (0 where not held)
    """
    total = tl.zeros_like(base)
    for b0 in range(0, width, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        live = held[:, None] & (b < width)[None, :]
        byte = tl.load(ptr + base[:, None] + b[None, :], mask=live, other=0)
        w = tl.load(w_ptr + w_at[:, None] + b[None, :], mask=live, other=0)
        total = (total + tl.sum(byte.to(tl.int64) * w, axis=1)) % PRIME
    return total


@triton.jit
def _block_of(table_ptr, row, table_stride, table_width, index, valid):
    """The block table entry ``index`` of ``row`` where valid (and inside the table), else -1.

    # index: [T] int64; valid: [T] bool -> [T] int64
    """
    column = tl.where(valid, index, 0)
    block = tl.load(table_ptr + row * table_stride + column, mask=valid & (column < table_width), other=-1)
    return block.to(tl.int64)


@triton.jit
def _mla_sum(pos, w_at, table_ptr, row, table_stride, table_width, mla_ptr, block_size, mla_block, mla_token,
             mla_head, mla_heads, head_bytes, w_ptr, BLOCK_B: tl.constexpr):
    """The weighted MLA bytes [H, E] of each position (-1 = none), weights from w_at on, modulo P.

    # pos, w_at: [T] int64 -> [T] int64 in [0, P)
    """
    valid = pos >= 0
    block = _block_of(table_ptr, row, table_stride, table_width, pos // block_size, valid)
    held = block >= 0
    base = block * mla_block + (pos % block_size) * mla_token
    total = tl.zeros_like(pos)
    for h in range(mla_heads):
        total += _weighted_bytes(mla_ptr, base + h * mla_head, held, w_ptr, w_at + h * head_bytes, head_bytes, BLOCK_B)
    return total % PRIME


@triton.jit
def _open_sum(seq, ring, w_base, ring_ptr, ring_stride, slot_stride, ring_slots, ring_bytes, mla_w_base,
              table_ptr, row, table_stride, table_width, mla_ptr, block_size, mla_block, mla_token, mla_head,
              mla_heads, head_bytes, w_ptr, GROUP: tl.constexpr, OPEN_MLA: tl.constexpr, BLOCK_G: tl.constexpr,
              BLOCK_B: tl.constexpr):
    """The open pool's (group's) ring rows [L // g * g, L), weights from w_base on, and when OPEN_MLA their MLA
    bytes, weights from mla_w_base on (position j of the open pool is attended token j there), modulo P.

    # seq, ring: int64 scalars -> int64 in [0, P)
    """
    j = tl.arange(0, BLOCK_G).to(tl.int64)
    pos = seq // GROUP * GROUP + j
    live = (j < GROUP - 1) & (pos < seq)
    rings = tl.where(live, ring, -1)  # [BLOCK_G]: Triton's interpreter rejects a mask and-ed with a scalar bool
    base = rings * ring_stride + (pos % ring_slots) * slot_stride
    rows = _weighted_bytes(ring_ptr, base, rings >= 0, w_ptr, w_base + j * ring_bytes, ring_bytes, BLOCK_B)
    total = tl.sum(rows)
    if OPEN_MLA:
        token_bytes = mla_heads * head_bytes
        mla = _mla_sum(tl.where(live, pos, -1), mla_w_base + j * token_bytes, table_ptr, row, table_stride,
                       table_width, mla_ptr, block_size, mla_block, mla_token, mla_head, mla_heads, head_bytes, w_ptr,
                       BLOCK_B)
        total += tl.sum(mla)
    return total % PRIME


@triton.jit
def _selection_tile(sel_ptr, row, sel_stride, k0, topk, w_ptr, table_ptr, table_stride, table_width, block_size,
                    GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """A tile of a row's selection (pools or compressed rows of GROUP tokens): the indices, their weighted
    (index + 1) terms, and each one's block (-1 where none).

    # -> k: [BLOCK_K] int64, sel: [BLOCK_K] int64 (-1 = none), terms: [BLOCK_K] int64, block: [BLOCK_K] int64
    """
    k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
    live = k < topk
    sel = tl.load(sel_ptr + row * sel_stride + k, mask=live, other=-1)
    terms = (sel + 1) * tl.load(w_ptr + k, mask=live, other=0)
    block = _block_of(table_ptr, row, table_stride, table_width, sel * GROUP // block_size, sel >= 0)
    return k, sel, terms, block


@triton.jit
def _kpool_kernel(acc_ptr, w_ptr, pools_ptr, seq_ptr, table_ptr, ring_ids_ptr, iq_ptr, is_ptr, ring_ptr, mla_ptr,
                  out_ptr, topk, pools_stride, table_stride, table_width, states, iq_block, iq_page, iq_entry,
                  is_block, is_page, is_entry, ring_stride, slot_stride, ring_slots, ring_bytes, mla_block, mla_token,
                  mla_head, mla_heads, head_bytes, PAGE: tl.constexpr, KPOOL: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_B: tl.constexpr):
    # acc, out: [Q] int64; w: [F] int64; pools: [Q, topk] int64 (-1 = none); seq: [Q] int; table: [Q, M] int
    # ring_ids: [Q] int; iq: [num_blocks, pages, PAGE, 128] uint8; is: [num_blocks, pages, PAGE] int32 (fp32 bits)
    # ring: [num_rings, ring_slots, ring_bytes] uint8; mla: [num_blocks, block_size, H, E] uint8
    row = tl.program_id(0).to(tl.int64)
    seq = tl.load(seq_ptr + row).to(tl.int64)
    ring = tl.load(ring_ids_ptr + row).to(tl.int64)
    block_size = states * KPOOL
    token_bytes = mla_heads * head_bytes
    entry_w = topk
    ring_w = entry_w + topk * ENTRY_BYTES
    mla_w = ring_w + (KPOOL - 1) * ring_bytes
    # the selection, its entries
    selected = tl.zeros([BLOCK_K], tl.int64)
    for k0 in range(0, topk, BLOCK_K):
        k, pool, terms, block = _selection_tile(pools_ptr, row, pools_stride, k0, topk, w_ptr, table_ptr,
                                                table_stride, table_width, block_size, KPOOL, BLOCK_K)
        selected += terms
        held = block >= 0
        q_at, scale_at = entry_offsets(block, pool % states, PAGE, iq_block, iq_page, iq_entry, is_block, is_page,
                                       is_entry)
        selected += _weighted_bytes(iq_ptr, q_at, held, w_ptr, entry_w + k * ENTRY_BYTES, CODE_BYTES, BLOCK_B)
        bits = tl.load(is_ptr + scale_at, mask=held, other=0)
        shift = tl.arange(0, 4)
        scale_bytes = ((bits[:, None] >> (shift * 8)[None, :]) & 0xFF).to(tl.int64)
        w = tl.load(w_ptr + (entry_w + k * ENTRY_BYTES + CODE_BYTES)[:, None] + shift[None, :],
                    mask=held[:, None], other=0)
        selected = (selected + tl.sum(scale_bytes * w, axis=1)) % PRIME
    # the MLA bytes of the selected pools' tokens
    attended = tl.zeros([BLOCK_T], tl.int64)
    for a0 in range(0, topk * KPOOL, BLOCK_T):
        a = a0 + tl.arange(0, BLOCK_T).to(tl.int64)
        live = a < topk * KPOOL
        pool = tl.load(pools_ptr + row * pools_stride + a // KPOOL, mask=live, other=-1)
        pos = tl.where(pool >= 0, pool * KPOOL + a % KPOOL, -1)
        attended += _mla_sum(pos, mla_w + a * token_bytes, table_ptr, row, table_stride, table_width, mla_ptr,
                             block_size, mla_block, mla_token, mla_head, mla_heads, head_bytes, w_ptr, BLOCK_B)
        attended = attended % PRIME
    # the open pool: ring rows and MLA bytes
    opened = _open_sum(seq, ring, ring_w, ring_ptr, ring_stride, slot_stride, ring_slots, ring_bytes,
                       mla_w + topk * KPOOL * token_bytes, table_ptr, row, table_stride, table_width, mla_ptr,
                       block_size, mla_block, mla_token, mla_head, mla_heads, head_bytes, w_ptr, KPOOL, True,
                       BLOCK_G, BLOCK_B)
    layer_hash = (tl.sum(selected) % PRIME + tl.sum(attended) % PRIME + opened) % PRIME
    acc = tl.load(acc_ptr + row)
    tl.store(out_ptr + row, (acc * MULTIPLIER + layer_hash) % PRIME)


@triton.jit
def _qsa_kernel(acc_ptr, w_ptr, chosen_ptr, tokens_ptr, seq_ptr, table_ptr, ring_ids_ptr, keys_ptr, ring_ptr, mla_ptr,
                out_ptr, topk, chosen_stride, num_tokens, tokens_stride, table_stride, table_width, rows_per_block,
                keys_block, keys_row, keys_head, keys_heads, key_bytes, ring_stride, slot_stride, ring_slots,
                ring_bytes, mla_block, mla_token, mla_head, mla_heads, head_bytes, RATIO: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_B: tl.constexpr):
    # acc, out: [Q] int64; w: [F] int64; chosen: [Q, topk] int64 (-1 = none); tokens: [Q, num_tokens] int64
    # seq: [Q] int; table: [Q, M] int; ring_ids: [Q] int; keys: [num_blocks, rows_per_block, H, key_bytes] uint8
    # ring: [num_rings, ring_slots, ring_bytes] uint8; mla: [num_blocks, block_size, H', E] uint8
    row = tl.program_id(0).to(tl.int64)
    seq = tl.load(seq_ptr + row).to(tl.int64)
    ring = tl.load(ring_ids_ptr + row).to(tl.int64)
    block_size = rows_per_block * RATIO
    row_bytes = keys_heads * key_bytes
    token_bytes = mla_heads * head_bytes
    keys_w = topk
    ring_w = keys_w + topk * row_bytes
    mla_w = ring_w + (RATIO - 1) * ring_bytes
    # the selection, its compressed rows
    selected = tl.zeros([BLOCK_K], tl.int64)
    for k0 in range(0, topk, BLOCK_K):
        k, chosen, terms, block = _selection_tile(chosen_ptr, row, chosen_stride, k0, topk, w_ptr, table_ptr,
                                                  table_stride, table_width, block_size, RATIO, BLOCK_K)
        selected += terms
        held = block >= 0
        base = block * keys_block + (chosen % rows_per_block) * keys_row
        for h in range(keys_heads):
            selected += _weighted_bytes(keys_ptr, base + h * keys_head, held, w_ptr,
                                        keys_w + k * row_bytes + h * key_bytes, key_bytes, BLOCK_B)
        selected = selected % PRIME
    # the MLA bytes of the attended tokens (chosen rows' tokens, then the open group's)
    attended = tl.zeros([BLOCK_T], tl.int64)
    for a0 in range(0, num_tokens, BLOCK_T):
        a = a0 + tl.arange(0, BLOCK_T).to(tl.int64)
        live = a < num_tokens
        pos = tl.load(tokens_ptr + row * tokens_stride + a, mask=live, other=-1)
        attended += _mla_sum(pos, mla_w + a * token_bytes, table_ptr, row, table_stride, table_width, mla_ptr,
                             block_size, mla_block, mla_token, mla_head, mla_heads, head_bytes, w_ptr, BLOCK_B)
        attended = attended % PRIME
    # the open group's ring rows (its MLA bytes are among the attended tokens above)
    opened = _open_sum(seq, ring, ring_w, ring_ptr, ring_stride, slot_stride, ring_slots, ring_bytes, mla_w,
                       table_ptr, row, table_stride, table_width, mla_ptr, block_size, mla_block, mla_token, mla_head,
                       mla_heads, head_bytes, w_ptr, RATIO, False, BLOCK_G, BLOCK_B)
    layer_hash = (tl.sum(selected) % PRIME + tl.sum(attended) % PRIME + opened) % PRIME
    acc = tl.load(acc_ptr + row)
    tl.store(out_ptr + row, (acc * MULTIPLIER + layer_hash) % PRIME)


def _ring_and_mla_args(ring_rows: torch.Tensor, mla: torch.Tensor) -> tuple[int, ...]:
    """(ring, slot strides, ring slots, ring row bytes, mla block, token, head strides, heads, bytes per head).

    # ring_rows: [num_rings, ring_slots, ring_row_bytes] uint8; mla: [num_blocks, block_size, H, E] uint8
    """
    assert ring_rows.stride(2) == 1, f"ring rows must be contiguous in their bytes, got strides {ring_rows.stride()}"
    assert mla.stride(3) == 1, f"MLA entries must be contiguous in their bytes, got strides {mla.stride()}"
    return (ring_rows.stride(0), ring_rows.stride(1), ring_rows.shape[1], ring_rows.shape[2],
            mla.stride(0), mla.stride(1), mla.stride(2), mla.shape[2], mla.shape[3])


def _open_tile(group: int) -> int:
    return triton.next_power_of_2(max(group - 1, 2))  # a tile of at least two: no size-1 arange


def kpool_layer_hash_triton(acc: torch.Tensor, weights: torch.Tensor, pools: torch.Tensor, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, ring_ids: torch.Tensor, indexer_q: torch.Tensor,
                            indexer_scale: torch.Tensor, ring_rows: torch.Tensor, mla: torch.Tensor, *,
                            kpool: int) -> torch.Tensor:
    """# as ``ref.kpool_layer_hash`` (arguments checked by the caller) -> [Q] int64 in [0, P)"""
    rows = acc.shape[0]
    out = torch.empty_like(acc)
    if rows == 0:
        return out
    pools, table, weights = pools.contiguous(), block_table.contiguous(), weights.contiguous()
    _kpool_kernel[(rows,)](
        acc, weights, pools, seq_lens, table, ring_ids, indexer_q.view(torch.uint8), indexer_scale.view(torch.int32),
        ring_rows, mla, out, pools.shape[1], pools.stride(0), table.stride(0), table.shape[1],
        indexer_q.shape[1] * indexer_q.shape[2], *page_strides(indexer_q, indexer_scale),
        *_ring_and_mla_args(ring_rows, mla), PAGE=indexer_q.shape[2], KPOOL=kpool, BLOCK_K=BLOCK_K, BLOCK_T=BLOCK_T,
        BLOCK_G=_open_tile(kpool), BLOCK_B=BLOCK_B, num_warps=4,
    )
    return out


def qsa_layer_hash_triton(acc: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, token_indices: torch.Tensor,
                          seq_lens: torch.Tensor, block_table: torch.Tensor, ring_ids: torch.Tensor,
                          compressed: torch.Tensor, ring_rows: torch.Tensor, mla: torch.Tensor, *,
                          compress_ratio: int) -> torch.Tensor:
    """# as ``ref.qsa_layer_hash`` (arguments checked by the caller) -> [Q] int64 in [0, P)"""
    rows = acc.shape[0]
    out = torch.empty_like(acc)
    if rows == 0:
        return out
    chosen, tokens = chosen.contiguous(), token_indices.contiguous()
    table, weights = block_table.contiguous(), weights.contiguous()
    keys = compressed.view(torch.uint8)  # [num_blocks, rows_per_block, H, D * element bytes]
    assert keys.stride(3) == 1, f"compressed rows must be contiguous in D, got strides {compressed.stride()}"
    _qsa_kernel[(rows,)](
        acc, weights, chosen, tokens, seq_lens, table, ring_ids, keys, ring_rows, mla, out, chosen.shape[1],
        chosen.stride(0), tokens.shape[1], tokens.stride(0), table.stride(0), table.shape[1], keys.shape[1],
        keys.stride(0), keys.stride(1), keys.stride(2), keys.shape[2], keys.shape[3],
        *_ring_and_mla_args(ring_rows, mla), RATIO=compress_ratio, BLOCK_K=BLOCK_K, BLOCK_T=BLOCK_T,
        BLOCK_G=_open_tile(compress_ratio), BLOCK_B=BLOCK_B, num_warps=4,
    )
    return out
