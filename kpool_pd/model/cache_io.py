"""Byte-level reads and writes of the pool that both families share: MLA entries and ring rows.

Reads gather rows for many (row, position) pairs at once and zero the invalid ones, so the
caller gets fixed-width bytes per query row.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from kpool_pd.kernels import write_mla_rows
from kpool_pd.kvcache import CacheConfig, CachePool


def mla_destinations(block_size: int, block_table: torch.Tensor, request: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's MLA row (block, offset in it), the same in every layer; block -1 for a token whose
    position is negative or lies past its request's blocks (a padded batch's extra tokens).

    # block_table: [B, M] int32; request, positions: [T] int64 -> blocks, offsets: [T] int64
    """
    column = torch.where(positions >= 0, positions, 0) // block_size
    inside = (positions >= 0) & (column < block_table.shape[1])
    blocks = block_table.to(torch.int64)[request, torch.where(inside, column, 0)]
    return torch.where(inside, blocks, -1), positions % block_size


def write_mla(pool: CachePool, layer: int, block_table: torch.Tensor, request: torch.Tensor,
              positions: torch.Tensor, entries: torch.Tensor) -> None:
    """Store each token's MLA entry at its position; a token without a row (``mla_destinations``) writes
    nothing. No host synchronisation.

    # block_table: [B, M] int32; request, positions: [T] int64; entries: [T, E] uint8
    """
    blocks, offsets = mla_destinations(pool.config.block_size, block_table, request, positions)
    write_mla_rows(pool.mla(layer), blocks, offsets, entries)


def read_mla(pool: CachePool, layer: int, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """MLA bytes of positions (-1 = none: zeros).

    # block_table: [Q, M] int32 (each row's table); positions: [Q, N] int64 -> [Q, N, H * E] uint8
    """
    return gather_mla(pool.mla(layer), block_table, positions)


def gather_mla(mla: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``read_mla`` on one layer's MLA view (``CachePool.mla``): positions -1, or on a block -1, give zeros.

    # mla: [num_blocks, block_size, H, E] uint8; block_table: [Q, M] int; positions: [Q, N] int64
    # -> [Q, N, H * E] uint8
    """
    block_size = mla.shape[1]
    valid = positions >= 0
    safe = torch.where(valid, positions, 0)
    blocks = torch.gather(block_table.to(torch.int64), 1, safe // block_size)
    valid = valid & (blocks >= 0)
    entries = mla[torch.where(valid, blocks, 0), safe % block_size]  # [Q, N, H, E]
    entries = entries.reshape(*positions.shape, -1)
    return torch.where(valid[..., None], entries, torch.zeros((), dtype=torch.uint8, device=entries.device))


def layer_ring_rows(pool: CachePool, layer: int) -> torch.Tensor:
    """One layer's rows of every ring slot, a strided view of the ring pool.

    # -> [num_rings, ring_slots, ring_row_bytes] uint8
    """
    layout = pool.layout
    offset = layout.layer(layer).ring_row_offset
    slots = pool.rings.view(pool.num_rings, layout.ring_slots, layout.ring_slot_bytes)
    return slots[:, :, offset:offset + layout.ring_row_bytes]


def read_ring_rows(pool: CachePool, layer: int, ring_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One layer's ring rows (kpool: K then gate; QSA: key row with packed positions) of positions
    (-1 = none: zeros).

    # ring_ids: [Q] int; positions: [Q, N] int64 -> [Q, N, ring_row_bytes] uint8
    """
    return gather_ring_rows(layer_ring_rows(pool, layer), ring_ids, positions)


def gather_ring_rows(ring_rows: torch.Tensor, ring_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``read_ring_rows`` on one layer's ring view (``layer_ring_rows``): position p lives in slot
    p % ring_slots; positions -1, or a ring id -1, give zeros.

    # ring_rows: [num_rings, ring_slots, row_bytes] uint8; ring_ids: [Q] int; positions: [Q, N] int64
    # -> [Q, N, row_bytes] uint8
    """
    ring = ring_ids.to(torch.int64)[:, None]
    valid = (positions >= 0) & (ring >= 0)
    slot = torch.where(valid, positions, 0) % ring_rows.shape[1]
    rows = ring_rows[torch.where(valid, ring, 0), slot]
    return torch.where(valid[..., None], rows, torch.zeros((), dtype=torch.uint8, device=rows.device))


def open_positions(config: CacheConfig, seq_lens: torch.Tensor) -> torch.Tensor:
    """Positions of each row's open pool (group) of g = ``config.tokens_per_entry`` tokens:
    [open_entry_start(L), L), -1 padded to g - 1.

    # seq_lens: [Q] int -> [Q, g - 1] int64
    """
    return open_group_positions(seq_lens, config.tokens_per_entry)


def open_group_positions(seq_lens: torch.Tensor, group: int) -> torch.Tensor:
    """``open_positions`` for entries of ``group`` tokens: [L // g * g, L), -1 padded to g - 1.

    # seq_lens: [Q] int -> [Q, group - 1] int64
    """
    seq = seq_lens.to(torch.int64)[:, None]
    pos = seq // group * group + torch.arange(max(group - 1, 0), device=seq_lens.device)[None]
    return torch.where(pos < seq, pos, -1)


def layer_stack(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every layer's view of one cache field as one strided view, layer first (no copy): a layout puts the
    layers' pages a constant distance apart, so their views share shape, strides, dtype and storage and
    their offsets step evenly. ValueError where they do not.

    # views: L x [*S] -> [L, *S]
    """
    if not views:
        raise ValueError("layer_stack needs at least one layer's view")
    first = views[0]
    offsets = [v.storage_offset() for v in views]
    step = offsets[1] - offsets[0] if len(views) > 1 else 0
    for layer, view in enumerate(views):
        if (view.shape, view.stride(), view.dtype) != (first.shape, first.stride(), first.dtype) \
                or view.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() \
                or offsets[layer] != offsets[0] + layer * step:
            raise ValueError(f"layer {layer}'s view ({view.dtype} {list(view.shape)}, strides {view.stride()}, offset "
                             f"{offsets[layer]}) does not continue layer 0's ({first.dtype} {list(first.shape)}, "
                             f"strides {first.stride()}, offsets stepping {step})")
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), offsets[0])


class LayerStacks:
    """One pool's per-layer views stacked layer first (``layer_stack``), each made once, on first use: reads of a
    request's bytes in every layer index them in a few launches (the state digest).

    # mla: [L, num_blocks, N, H, C] uint8; ring_rows: [L, num_rings, ring_slots, ring_row_bytes] uint8
    # kpool: indexer_q [L, num_blocks, pages, states_per_page, 128] fp8, indexer_scale [L, num_blocks, pages,
    #        states_per_page] fp32; QSA: qsa_keys [L, num_blocks, rows, H, D]
    """

    def __init__(self, pool: CachePool) -> None:
        self.pool = pool
        self._layers = range(len(pool.layout.layers))

    def _stack(self, view_of) -> torch.Tensor:
        return layer_stack([view_of(layer) for layer in self._layers])

    @functools.cached_property
    def mla(self) -> torch.Tensor:
        return self._stack(self.pool.mla)

    @functools.cached_property
    def ring_rows(self) -> torch.Tensor:
        return self._stack(lambda layer: layer_ring_rows(self.pool, layer))

    @functools.cached_property
    def indexer_q(self) -> torch.Tensor:
        return self._stack(self.pool.indexer_q)

    @functools.cached_property
    def indexer_scale(self) -> torch.Tensor:
        return self._stack(self.pool.indexer_scale)

    @functools.cached_property
    def qsa_keys(self) -> torch.Tensor:
        return self._stack(self.pool.qsa_keys)


def request_ring_rows(stacks: LayerStacks, ring_id: int, length: int) -> torch.Tensor:
    """Every layer's ring rows of the open pool (group) of a request of ``length`` tokens, in position order:
    ``read_ring_rows`` of each layer at once.

    # -> [L, length - open_entry_start(length), ring_row_bytes] uint8
    """
    pool = stacks.pool
    positions = torch.arange(pool.config.open_entry_start(length), length, device=pool.device)
    rows = stacks.ring_rows
    return rows[:, ring_id, positions % rows.shape[2]]


def request_mla_rows(stacks: LayerStacks, table: torch.Tensor, length: int) -> torch.Tensor:
    """Every layer's MLA bytes of positions [0, length) of a request whose block table is ``table``.

    # table: [>= ceil(length / block_size)] int64 -> [L, length, H, E] uint8
    """
    block_size = stacks.pool.config.block_size
    positions = torch.arange(length, device=stacks.pool.device)
    return stacks.mla[:, table[positions // block_size], positions % block_size]
