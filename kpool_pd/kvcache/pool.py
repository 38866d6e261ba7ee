"""The memory of one worker: a block pool and a ring pool, with typed per-layer views.

Every view aliases the pool's bytes (no copies): writing through a view changes the block,
and a transfer of a block's bytes moves every layer's pages at once. The block views are the layout's
field geometry (``BlockLayout.fields``) with a dtype.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from kpool_pd.kvcache.family import KpoolFamilySpec, QsaFamilySpec
from kpool_pd.kvcache.layout import BlockLayout, FieldKind
from kpool_pd.kvcache.specs import INDEX_HEAD_DIM

_Spec = TypeVar("_Spec", KpoolFamilySpec, QsaFamilySpec)


class CachePool:
    """``blocks: [num_blocks, block_bytes] uint8`` and ``rings: [num_rings, ring_block_bytes] uint8``."""

    def __init__(self, layout: BlockLayout, *, num_blocks: int, num_rings: int, device: str | torch.device = "cpu") -> None:
        for name, value in (("num_blocks", num_blocks), ("num_rings", num_rings)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.layout = layout
        self.config = layout.config
        self.family_spec = layout.config.family_spec
        self.num_blocks = num_blocks
        self.num_rings = num_rings
        self.blocks = torch.zeros(num_blocks, layout.block_bytes, dtype=torch.uint8, device=device)
        self.rings = torch.zeros(num_rings, layout.ring_block_bytes, dtype=torch.uint8, device=device)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def block_plane(self, index: int) -> torch.Tensor:
        """uint8 [num_blocks * block_bytes]: the block pool, flat (the unified layout has one plane, 0)."""
        if index != 0:
            raise ValueError(f"the unified block layout has one plane, 0; got {index}")
        return self.blocks.view(-1)

    def _block_bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.blocks[:, offset:offset + nbytes]

    def _field(self, kind: FieldKind, layer: int | str) -> torch.Tensor:
        """uint8 [num_blocks, pages, rows_per_page, heads, piece]: one layer's field (``FieldGeometry.view``)."""
        return self.layout.field(kind).view(self.blocks, self.layout.layer(layer).index)

    def _ring_rows(self, layer: int | str) -> torch.Tensor:
        """uint8 [num_rings, slots, row_bytes]: one layer's rows, strided across the slot-major ring."""
        pages = self.layout.layer(layer)
        slots = self.rings.view(self.num_rings, self.layout.ring_slots, self.layout.ring_slot_bytes)
        return slots[:, :, pages.ring_row_offset:pages.ring_row_offset + self.layout.ring_row_bytes]

    def _family_spec(self, kind: type[_Spec], what: str) -> _Spec:
        """The pool's family spec when it is of ``kind``; ValueError naming both families otherwise."""
        spec = self.family_spec
        if not isinstance(spec, kind):
            raise ValueError(f"{what} exists only in the {kind.family.value} family; this pool is {spec.family.value}")
        return spec

    # Main attention ------------------------------------------------------------------
    def mla(self, layer: int | str) -> torch.Tensor:
        """uint8 [num_blocks, N, H, C] in logical order; for BLHNC the view is strided over its
        storage order [num_blocks, H, N, C]."""
        return self._field(FieldKind.MLA, layer)[:, 0]

    # kpool family --------------------------------------------------------------------
    def indexer_page(self, layer: int | str) -> torch.Tensor:
        """uint8 [num_blocks, S * 132]: one layer's kernel pages, back to back; each page holds its
        entries' fp8 bytes state-major, then their fp32 scales."""
        self._family_spec(KpoolFamilySpec, "the kpool indexer page")
        return self._block_bytes(self.layout.layer(layer).indexer_offset, self.layout.indexer_page_bytes)

    def indexer_q(self, layer: int | str) -> torch.Tensor:
        """float8_e4m3fn [num_blocks, pages, states_per_page, 128]: state s of a block is
        ``[block, s // states_per_page, s % states_per_page]``."""
        self._family_spec(KpoolFamilySpec, "the kpool indexer page")
        return self._field(FieldKind.KPOOL_ENTRY, layer)[:, :, :, 0].view(torch.float8_e4m3fn)

    def indexer_scale(self, layer: int | str) -> torch.Tensor:
        """float32 [num_blocks, pages, states_per_page]."""
        self._family_spec(KpoolFamilySpec, "the kpool indexer page")
        return self._field(FieldKind.KPOOL_SCALE, layer)[:, :, :, 0].view(torch.float32)[..., 0]

    def tail_ring(self, layer: int | str) -> torch.Tensor:
        """bf16 [num_rings, 2, R, 128]: raw K half, then gate half (a strided view)."""
        r = self._family_spec(KpoolFamilySpec, "the tail ring").ring_slots
        rows = self._ring_rows(layer).view(torch.bfloat16).view(self.num_rings, r, 2, INDEX_HEAD_DIM)
        return rows.permute(0, 2, 1, 3)

    # QSA family ----------------------------------------------------------------------
    def qsa_keys(self, layer: int | str) -> torch.Tensor:
        """bf16 or fp8 [num_blocks, rows, H, D] in logical order; for BLHNC the view is strided over
        its storage order [num_blocks, H, rows, D]."""
        spec = self._family_spec(QsaFamilySpec, "the QSA compressed key cache").keys
        return self._field(FieldKind.QSA_KEYS, layer)[:, 0].view(spec.dtype.torch_dtype)

    def qsa_ring(self, layer: int | str) -> torch.Tensor:
        """bf16 [num_rings, C, H, W]; W = off + 12 when positions are cached."""
        spec = self._family_spec(QsaFamilySpec, "the QSA key state ring").ring
        rows = self._ring_rows(layer).view(torch.bfloat16)
        return rows.view(self.num_rings, spec.capacity, spec.num_heads, spec.row_width)
