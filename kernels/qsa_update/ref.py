"""One forward's QSA cache update: compress the completed groups, then stash the ring rows.

The same op serves a prefill chunk and a decode step (the last committed token plus its
drafts): both are a chunk ``[start, seq_len)`` of consecutive positions per request, and
``build_qsa_metadata`` already lists the groups that the chunk completes (``k_work``) and
the ring rows it writes.

For every work item (request ``b``, group ``g``) the op gathers the group's ``r`` raw keys:
positions inside the chunk from this forward's ``keys``, older positions from the request's
ring (only the chunk's first group can straddle the boundary). The group's first MRoPE
position comes from this forward's ``positions``, or, for an older first token, from the
ring's packed positions (``cache_rope_positions``) or else the text position
``(p, p, p)``. The group is compressed (``kernels.qsa_compress``) and written to its row of
the compressed cache. **Only then** are the ring rows written.

Reads before writes is required, not a convenience: a prefill chunk longer than ``C`` writes
its last ``C`` tokens to the ring, and those rows can be the very rows that hold the
straddling group's older keys. Example: ``r = C = 4``, the previous chunk ended at position
4 (ring row 0 holds position 4), this chunk covers positions 5..14; its group 1 (positions
4..7) needs position 4 from row 0, and position 12 is written to row 0 by this chunk.

A decode step's rejected drafts write garbage into ring rows and compressed rows past the
committed length; the next step rewrites them, and ``C >= r + num_spec`` guarantees that
a step never overwrites the committed open group that its redo reads.
"""

from __future__ import annotations

import torch

from kernels.qsa_compress.ref import QSA_ROW_DTYPES, compress_group_keys
from kernels.qsa_metadata.ref import QsaMetadata
from kernels.qsa_ring.ref import POSITION_SLOTS, position_offset, read_qsa_ring_positions, write_qsa_ring
from kernels.qsa_rope.ref import mrope_axis_of_pair, text_positions

_BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)} on {t.device}"
    return type(t).__name__


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
        raise ValueError(f"keys must be bf16 [T={metadata.num_tokens}, H, D], got {_describe(keys)}")
    num_tokens, num_heads, head_size = keys.shape
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 \
            or tuple(positions.shape) != (num_tokens, 3):
        raise ValueError(f"positions must be int64 [{num_tokens}, 3], got {_describe(positions)}")
    if not isinstance(ring, torch.Tensor) or ring.dtype != torch.bfloat16 or ring.dim() != 4 \
            or ring.shape[1] != metadata.ring_capacity or ring.shape[2] != num_heads:
        raise ValueError(
            f"ring must be bf16 [num_rings, C={metadata.ring_capacity}, H={num_heads}, W], got {_describe(ring)}"
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
            f"got {_describe(compressed)}"
        )
    mrope_axis_of_pair(rotary_dim, section)  # checks the rotary parameters even when no group closes
    if rotary_dim > head_size:
        raise ValueError(f"rotary_dim {rotary_dim} must be <= head size D = {head_size}")
    if not isinstance(norm_weight, torch.Tensor) or norm_weight.dtype != torch.float32 \
            or tuple(norm_weight.shape) != (head_size,):
        raise ValueError(f"norm_weight must be fp32 [{head_size}], got {_describe(norm_weight)}")
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


def qsa_forward_update(
    keys: torch.Tensor,
    positions: torch.Tensor,
    metadata: QsaMetadata,
    ring: torch.Tensor,
    compressed: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    compress_ratio: int,
    block_size: int,
    eps: float,
    rotary_dim: int,
    theta: float,
    section: tuple[int, int, int],
    cache_rope_positions: bool,
) -> None:
    # keys: [T, H, D] bf16; positions: [T, 3] int64; ring: [num_rings, C, H, W] bf16 (in place);
    # compressed: [num_blocks, block_size / r, H, D] bf16 | fp8_e4m3 (in place, any strides); norm_weight: [D] fp32
    """Write the compressed rows of every group this forward completes, then its ring rows.

    Called once per layer per forward, after the layer's keys are computed. Not idempotent
    in general: a second call sees the ring rows of the first. ValueError (or TypeError
    for a non-metadata argument) names bad inputs before anything is written.
    """
    check_update_args(
        keys, positions, metadata, ring, compressed, norm_weight, compress_ratio, block_size, rotary_dim, section,
        cache_rope_positions,
    )
    check_update_values(metadata, ring, compressed)
    r, cap = compress_ratio, metadata.ring_capacity
    rows_per_block = metadata.rows_per_block
    device = keys.device
    head_size = keys.shape[2]
    num_work = int(metadata.num_work[0])

    if num_work:
        q_start = metadata.query_start_loc.to(torch.int64)
        chunk_start = metadata.seq_lens.to(torch.int64) - (q_start[1:] - q_start[:-1])  # [B]
        work = metadata.k_work[:num_work].to(torch.int64)
        req = work[:, 0]
        group = chunk_start[req] // r + work[:, 1]  # [n] absolute group index
        start = chunk_start[req][:, None]
        group_pos = group[:, None] * r + torch.arange(r, device=device)  # [n, r]
        in_chunk = group_pos >= start
        token = q_start[req][:, None] + (group_pos - start)  # index into this forward's tokens

        # Gather the raw keys as bit patterns: chunk tokens, or ring rows for older positions.
        key_bits = keys.view(torch.int16)
        from_chunk = key_bits[token.clamp(min=0)]  # [n, r, H, D]; clamped rows are masked below
        ring_id = metadata.ring_blocks.to(torch.int64)[req][:, None]
        from_ring = ring.view(torch.int16)[ring_id, group_pos % cap][..., :head_size]
        group_keys = torch.where(in_chunk[:, :, None, None], from_chunk, from_ring).view(torch.bfloat16)

        first_pos = text_positions(group * r)  # [n, 3]; replaced below where known
        first_in_chunk = in_chunk[:, 0]
        first_pos[first_in_chunk] = positions[token[first_in_chunk, 0]]
        if cache_rope_positions:
            # At most one straddling group per request: read their packed positions one by one.
            for item in torch.nonzero(~first_in_chunk).flatten().tolist():
                slot = torch.tensor([int(group_pos[item, 0]) % cap], dtype=torch.int64, device=device)
                first_pos[item] = read_qsa_ring_positions(ring, int(ring_id[item, 0]), slot, head_size=head_size)[0]

        # The token that completes the group (the group's last) carries its compressed slot.
        slot = metadata.compressed_slot_mapping[token[:, r - 1]]
        assert bool((slot >= 0).all()), "k_work lists a group whose last token has no compressed slot"

        rows = compress_group_keys(
            group_keys, first_pos, norm_weight, eps=eps, rotary_dim=rotary_dim, theta=theta,
            section=section, out_dtype=compressed.dtype,
        )
        bits = _BITS[compressed.dtype]
        compressed.view(bits)[slot // rows_per_block, slot % rows_per_block] = rows.view(bits)

    write_qsa_ring(ring, keys, positions if cache_rope_positions else None, metadata.ring_slot_mapping)
