"""Argument checks of the QSA ops' public entry points (ValueError/TypeError naming the values).

The convention of every op in ``kernels``: the public entry (the op's ``__init__``) checks types, ranks,
dtypes, sizes and devices on every path, and the values (which need a host synchronisation) on CPU
tensors only; ``ref.py`` is the math alone. Index tensors (offsets, lengths, tables, ring ids, slots)
may be int32 or int64 (``kpool_pd.kernels.checks.check_int_tensor``); positions are int64.
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import check_int_tensor
from kpool_pd.kernels.qsa_compress.ref import QSA_ROW_DTYPES
from kpool_pd.kernels.qsa_metadata.ref import QsaMetadata
from kpool_pd.kernels.qsa_ring.ref import POSITION_SLOTS, position_offset
from kpool_pd.kernels.qsa_rope.ref import mrope_axis_of_pair


def describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)} on {t.device}"
    return type(t).__name__


def check_compress_args(
    keys: torch.Tensor, first_positions: torch.Tensor, norm_weight: torch.Tensor, *, eps: float, rotary_dim: int,
    out_dtype: torch.dtype,
) -> None:
    """Ranks, dtypes, sizes and devices of a compression (reads no tensor values)."""
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.bfloat16 or keys.dim() != 4 or keys.shape[1] < 1:
        raise ValueError(f"keys must be bf16 [G, r, H, D] with r >= 1, got {describe(keys)}")
    num_groups, _, _, head_size = keys.shape
    if not isinstance(first_positions, torch.Tensor) or first_positions.dtype != torch.int64 \
            or tuple(first_positions.shape) != (num_groups, 3):
        raise ValueError(f"first_positions must be int64 [{num_groups}, 3], got {describe(first_positions)}")
    if not isinstance(norm_weight, torch.Tensor) or norm_weight.dtype != torch.float32 \
            or tuple(norm_weight.shape) != (head_size,):
        raise ValueError(f"norm_weight must be fp32 [{head_size}], got {describe(norm_weight)}")
    if first_positions.device != keys.device or norm_weight.device != keys.device:
        raise ValueError(
            f"keys, first_positions and norm_weight must share a device, got "
            f"{keys.device}, {first_positions.device}, {norm_weight.device}"
        )
    if out_dtype not in QSA_ROW_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {out_dtype}")
    if not isinstance(rotary_dim, int) or rotary_dim > head_size:
        raise ValueError(f"rotary_dim {rotary_dim!r} must be an integer <= head size D = {head_size}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")


def check_metadata_args(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, ring_blocks: torch.Tensor,
    compress_ratio: int, ring_capacity: int, block_size: int,
) -> None:
    """Parameters, ranks, dtypes, sizes and devices (reads no tensor values: no host sync)."""
    params = (("compress_ratio", compress_ratio), ("ring_capacity", ring_capacity), ("block_size", block_size))
    for name, value in params:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if block_size % compress_ratio:
        raise ValueError(f"block_size {block_size} is not a multiple of compress_ratio {compress_ratio}")
    if ring_capacity < compress_ratio:
        raise ValueError(
            f"ring_capacity {ring_capacity} < compress_ratio {compress_ratio}: the ring cannot hold an open group"
        )
    check_int_tensor("query_start_loc", query_start_loc, 1)
    check_int_tensor("seq_lens", seq_lens, 1)
    check_int_tensor("block_table", block_table, 2)
    check_int_tensor("ring_blocks", ring_blocks, 1)
    num_requests = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_requests + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries, expected B + 1 = {num_requests + 1}")
    if block_table.shape[0] != num_requests or ring_blocks.shape[0] != num_requests:
        raise ValueError(
            f"block_table {list(block_table.shape)} and ring_blocks {list(ring_blocks.shape)} "
            f"must have B = {num_requests} rows"
        )
    for name, t in (("seq_lens", seq_lens), ("block_table", block_table), ("ring_blocks", ring_blocks)):
        if t.device != query_start_loc.device:
            raise ValueError(f"{name} is on {t.device}, query_start_loc on {query_start_loc.device}")


def check_metadata_values(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, ring_blocks: torch.Tensor,
    compress_ratio: int, block_size: int,
) -> None:
    """Offsets, lengths, ring blocks and the blocks that receive a group (reads the values: host sync)."""
    starts = query_start_loc.tolist()
    if starts[0] != 0:
        raise ValueError(f"query_start_loc must start at 0, got {starts[0]}")
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    for req, q_len in enumerate(q_lens):
        if q_len < 0:
            raise ValueError(
                f"query_start_loc is not monotone: entry {req} = {starts[req]} > entry {req + 1} = {starts[req + 1]}"
            )
    max_blocks = block_table.shape[1]
    for req, (q_len, seq_len, ring_block) in enumerate(zip(q_lens, seq_lens.tolist(), ring_blocks.tolist())):
        if q_len > seq_len:
            raise ValueError(f"request {req}: q_len {q_len} > seq_len {seq_len}")
        if seq_len > max_blocks * block_size:
            raise ValueError(
                f"request {req}: seq_len {seq_len} needs {-(-seq_len // block_size)} blocks of {block_size}, "
                f"but block_table has {max_blocks} columns"
            )
        if q_len and ring_block < 0:
            raise ValueError(f"request {req}: ring block {ring_block} is negative")
    table = block_table.tolist()
    for req, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens.tolist())):
        for group in range((seq_len - q_len) // compress_ratio, seq_len // compress_ratio):
            column = group * compress_ratio // block_size
            if table[req][column] < 0:
                raise ValueError(
                    f"request {req}: block_table column {column} holds block {table[req][column]}, but group "
                    f"{group} (position {(group + 1) * compress_ratio - 1}) is written there"
                )


def check_ring(ring: torch.Tensor) -> None:
    if not isinstance(ring, torch.Tensor) or ring.dtype != torch.bfloat16 or ring.dim() != 4:
        raise ValueError(f"ring must be bf16 [num_rings, C, H, W], got {describe(ring)}")
    if ring.stride(-1) != 1:
        raise ValueError(f"ring rows must be contiguous in their last dim, got strides {ring.stride()}")


def check_write_args(
    ring: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor | None, ring_slots: torch.Tensor,
) -> None:
    """Ranks, dtypes, sizes and devices of a ring write (reads no tensor values: no host sync)."""
    check_ring(ring)
    num_rings, capacity, num_heads, width = ring.shape
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.bfloat16 or keys.dim() != 3 \
            or keys.shape[1] != num_heads:
        raise ValueError(f"keys must be bf16 [T, H={num_heads}, D], got {describe(keys)}")
    num_tokens, _, head_size = keys.shape
    if head_size > width:
        raise ValueError(f"ring rows are {width} wide, too narrow for keys of head size D = {head_size}")
    check_int_tensor("ring_slots", ring_slots, 1)
    if ring_slots.shape[0] != num_tokens:
        raise ValueError(f"ring_slots must be [{num_tokens}] (one per token), got {describe(ring_slots)}")
    off = position_offset(head_size)
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 \
                or tuple(positions.shape) != (num_tokens, 3):
            raise ValueError(f"positions must be int64 [{num_tokens}, 3], got {describe(positions)}")
        if width != off + POSITION_SLOTS:
            raise ValueError(
                f"ring rows are {width} wide, but cached positions need W = off + 12 = "
                f"{off + POSITION_SLOTS} (head size {head_size}, off = ceil(D / 4) * 4 = {off})"
            )
    for name, t in (("keys", keys), ("ring_slots", ring_slots), ("positions", positions)):
        if t is not None and t.device != ring.device:
            raise ValueError(f"{name} is on {t.device}, the ring on {ring.device}")


def check_slot_values(ring_slots: torch.Tensor, num_rings: int, capacity: int) -> None:
    """Every slot is -1 or a row of the ring, and no row is named twice (reads the values: host sync)."""
    out_of_range = (ring_slots < -1) | (ring_slots >= num_rings * capacity)
    if bool(out_of_range.any()):
        raise ValueError(
            f"ring_slots {ring_slots[out_of_range].tolist()} out of range: "
            f"-1 (skip) or [0, num_rings * C = {num_rings * capacity})"
        )
    slots = ring_slots[ring_slots >= 0]
    if slots.unique().numel() != slots.numel():
        raise ValueError(f"ring_slots name one row twice in one write: {slots.tolist()}")


def check_read_args(ring: torch.Tensor, ring_id: int, slots: torch.Tensor, head_size: int | None) -> None:
    """Ranks, dtypes and ranges of a read of packed positions (reads the slot values: host sync)."""
    check_ring(ring)
    num_rings, capacity, _, width = ring.shape
    if not isinstance(ring_id, int) or not 0 <= ring_id < num_rings:
        raise ValueError(f"ring_id {ring_id!r} out of range [0, {num_rings})")
    check_int_tensor("slots", slots, 1)
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= capacity):
        raise ValueError(f"slots {slots.tolist()} out of range [0, C = {capacity})")
    off = width - POSITION_SLOTS
    if head_size is not None and position_offset(head_size) != off:
        raise ValueError(
            f"ring rows are {width} wide, but cached positions for head size {head_size} need "
            f"W = off + 12 = {position_offset(head_size) + POSITION_SLOTS}"
        )
    if off < 0:
        raise ValueError(f"ring rows are {width} wide: too narrow to hold 12 position slots")


def check_topk_args(
    q: torch.Tensor, compressed: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    compress_ratio: int, block_size: int, topk: int,
) -> None:
    """Parameters, ranks, dtypes, sizes and devices (reads no tensor values: no host sync)."""
    for name, value in (("compress_ratio", compress_ratio), ("block_size", block_size), ("topk", topk)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if block_size % compress_ratio:
        raise ValueError(f"block_size {block_size} is not a multiple of compress_ratio {compress_ratio}")
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 3:
        raise ValueError(f"q must be bf16 [B, Hq, D], got {describe(q)}")
    num_queries, num_q_heads, head_size = q.shape
    rows_per_block = block_size // compress_ratio
    if not isinstance(compressed, torch.Tensor) or compressed.dtype not in QSA_ROW_DTYPES \
            or compressed.dim() != 4 or compressed.shape[1] != rows_per_block or compressed.shape[3] != head_size:
        raise ValueError(
            f"compressed must be bf16 or fp8_e4m3 [num_blocks, rows={rows_per_block}, H, D={head_size}], "
            f"got {describe(compressed)}"
        )
    num_kv_heads = compressed.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads Hq = {num_q_heads} is not a multiple of the cache's kv heads H = {num_kv_heads}")
    check_int_tensor("seq_lens", seq_lens, 1)
    check_int_tensor("block_table", block_table, 2)
    if seq_lens.shape[0] != num_queries or block_table.shape[0] != num_queries:
        raise ValueError(f"seq_lens [{num_queries}] and block_table [{num_queries}, M] need one row per query, got "
                         f"{describe(seq_lens)} and {describe(block_table)}")
    for name, t in (("compressed", compressed), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def check_topk_values(
    compressed: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, compress_ratio: int, block_size: int,
) -> None:
    """Sequence lengths within the tables, visible rows in existing blocks (reads the values: host sync)."""
    max_blocks = block_table.shape[1]
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len < 0 or seq_len > max_blocks * block_size:
            raise ValueError(
                f"query {b}: seq_len {seq_len} must be in [0, {max_blocks * block_size}] "
                f"(block_table has {max_blocks} columns of {block_size} tokens)"
            )
    r = compress_ratio
    num_blocks = compressed.shape[0]
    visible = seq_lens.to(torch.int64) // r
    max_rows = int(visible.max()) if seq_lens.numel() else 0
    row = torch.arange(max_rows, device=seq_lens.device)
    is_visible = row[None, :] < visible[:, None]
    block_col = ((row * r) // block_size).clamp(max=max(max_blocks - 1, 0))
    block_id = torch.where(is_visible, block_table.to(torch.int64)[:, block_col], 0)
    bad = torch.nonzero((block_id < 0) | (block_id >= num_blocks))
    if bad.numel():
        b, j = bad[0].tolist()
        raise ValueError(
            f"query {b}: visible row {j} lives in block_table column {int(block_col[j])} = block "
            f"{int(block_id[b, j])}, outside the cache's blocks [0, {num_blocks})"
        )


def check_update_args(
    keys: torch.Tensor, positions: torch.Tensor, metadata: QsaMetadata, ring: torch.Tensor,
    compressed: torch.Tensor, norm_weight: torch.Tensor, compress_ratio: int, block_size: int,
    rotary_dim: int, section: tuple[int, int, int], cache_rope_positions: bool,
) -> None:
    """Types, ranks, dtypes, sizes and devices of a forward update (reads no tensor values: no host sync)."""
    if not isinstance(metadata, QsaMetadata):
        raise TypeError(f"metadata must be a QsaMetadata, got {type(metadata).__name__}")
    if compress_ratio != metadata.compress_ratio or block_size != metadata.block_size:
        raise ValueError(
            f"compress_ratio {compress_ratio} / block_size {block_size} differ from the metadata's "
            f"{metadata.compress_ratio} / {metadata.block_size}"
        )
    if not isinstance(keys, torch.Tensor) or keys.dtype != torch.bfloat16 or keys.dim() != 3 \
            or keys.shape[0] != metadata.num_tokens:
        raise ValueError(f"keys must be bf16 [T={metadata.num_tokens}, H, D], got {describe(keys)}")
    num_tokens, num_heads, head_size = keys.shape
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 \
            or tuple(positions.shape) != (num_tokens, 3):
        raise ValueError(f"positions must be int64 [{num_tokens}, 3], got {describe(positions)}")
    if not isinstance(ring, torch.Tensor) or ring.dtype != torch.bfloat16 or ring.dim() != 4 \
            or ring.shape[1] != metadata.ring_capacity or ring.shape[2] != num_heads:
        raise ValueError(
            f"ring must be bf16 [num_rings, C={metadata.ring_capacity}, H={num_heads}, W], got {describe(ring)}"
        )
    width = ring.shape[3]
    if cache_rope_positions and width != position_offset(head_size) + POSITION_SLOTS:
        raise ValueError(
            f"ring rows are {width} wide; cache_rope_positions needs W = off + 12 = "
            f"{position_offset(head_size) + POSITION_SLOTS} for head size {head_size}"
        )
    if not cache_rope_positions and width < head_size:
        raise ValueError(f"ring rows are {width} wide, too narrow for head size {head_size}")
    rows_per_block = metadata.rows_per_block
    if not isinstance(compressed, torch.Tensor) or compressed.dtype not in QSA_ROW_DTYPES \
            or compressed.dim() != 4 or tuple(compressed.shape[1:]) != (rows_per_block, num_heads, head_size):
        raise ValueError(
            f"compressed must be bf16 or fp8_e4m3 [num_blocks, rows={rows_per_block}, H={num_heads}, D={head_size}], "
            f"got {describe(compressed)}"
        )
    mrope_axis_of_pair(rotary_dim, section)  # checks the rotary parameters even when no group closes
    if rotary_dim > head_size:
        raise ValueError(f"rotary_dim {rotary_dim} must be <= head size D = {head_size}")
    if not isinstance(norm_weight, torch.Tensor) or norm_weight.dtype != torch.float32 \
            or tuple(norm_weight.shape) != (head_size,):
        raise ValueError(f"norm_weight must be fp32 [{head_size}], got {describe(norm_weight)}")
    for name, t in (("positions", positions), ("ring", ring), ("compressed", compressed),
                    ("norm_weight", norm_weight), ("metadata", metadata.seq_lens)):
        if t.device != keys.device:
            raise ValueError(f"{name} is on {t.device}, keys on {keys.device}")


def check_update_values(metadata: QsaMetadata, ring: torch.Tensor, compressed: torch.Tensor) -> None:
    """The rings and compressed rows this forward writes exist, and no row is written twice (host sync).

    The compressed rows are those of the group-completing tokens, one per ``k_work`` item, in its order.
    """
    q_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
    active_rings = metadata.ring_blocks[q_lens > 0]
    if bool((active_rings >= ring.shape[0]).any()):
        raise ValueError(f"ring_blocks {active_rings.tolist()} reach past the {ring.shape[0]} rings")
    slot = metadata.compressed_slot_mapping[metadata.compressed_slot_mapping >= 0]
    rows_per_block = metadata.rows_per_block
    if bool((slot >= compressed.shape[0] * rows_per_block).any()):
        raise ValueError(
            f"compressed slots {slot.tolist()} reach past the cache's {compressed.shape[0]} blocks "
            f"of {rows_per_block} rows"
        )
    if slot.unique().numel() != slot.numel():
        raise ValueError(f"two groups of this forward map to one compressed row: slots {slot.tolist()}")
