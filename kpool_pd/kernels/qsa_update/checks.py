"""Argument checks of a QSA forward's cache update: the op's public entry (``kpool_pd.kernels.qsa_update``) runs them before
either implementation (ValueError/TypeError naming the values; the convention is ``kpool_pd.kernels.checks``'s).
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import describe
from kpool_pd.kernels.qsa_compress.ref import QSA_ROW_DTYPES
from kpool_pd.kernels.qsa_metadata.ref import QsaMetadata
from kpool_pd.kernels.qsa_ring.ref import POSITION_SLOTS, position_offset
from kpool_pd.kernels.qsa_rope.ref import mrope_axis_of_pair


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
    """The rings and compressed rows this forward writes exist, no two requests with tokens share a ring (each
    request's ring rows are its own: the grid of a program per request relies on it), and no row is written
    twice (host sync).

    The compressed rows are those of the group-completing tokens, one per ``k_work`` item, in its order.
    """
    q_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
    active_rings = metadata.ring_blocks[q_lens > 0]
    if bool((active_rings >= ring.shape[0]).any()):
        raise ValueError(f"ring_blocks {active_rings.tolist()} reach past the {ring.shape[0]} rings")
    if active_rings.unique().numel() != active_rings.numel():
        raise ValueError(f"two requests of this forward share a ring: ring_blocks {active_rings.tolist()} "
                         "(of the requests with tokens)")
    slot = metadata.compressed_slot_mapping[metadata.compressed_slot_mapping >= 0]
    rows_per_block = metadata.rows_per_block
    if bool((slot >= compressed.shape[0] * rows_per_block).any()):
        raise ValueError(
            f"compressed slots {slot.tolist()} reach past the cache's {compressed.shape[0]} blocks "
            f"of {rows_per_block} rows"
        )
    if slot.unique().numel() != slot.numel():
        raise ValueError(f"two groups of this forward map to one compressed row: slots {slot.tolist()}")
