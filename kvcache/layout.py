"""The unified block layout (DESIGN section 4) and its hash.

A block holds ``block_size`` tokens of every layer, one contiguous byte range::

    block b: | layer 0: MLA page | layer 0: indexer pages | layer 1: MLA page | ... | pad |

A layer's kpool indexer pages are S / P kernel pages of P states each (one page of S states when
S <= P), back to back, each ``[P x 128 fp8 entries][P x 4 fp32 scales]`` (``KpoolIndexerSpec``).

A ring block holds every layer's ring of one request, **slot-major**::

    ring block: | slot 0: layer 0 row, layer 1 row, ... | slot 1: ... | ... | slot R-1 |

so the live range of a ring (consecutive positions, slots mod R) is one contiguous byte range,
or two when it wraps, whatever the number of layers. A layer's row in a slot is its K and gate
vectors (kpool: bf16[2, D]) or its key row (QSA: bf16[H, W]). Every block page starts on a
16-byte boundary so that typed views (fp8, bf16, fp32, int64) alias the bytes directly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kvcache.config import CacheConfig

PAGE_ALIGN = 16


def _align(n: int) -> int:
    return (n + PAGE_ALIGN - 1) // PAGE_ALIGN * PAGE_ALIGN


@dataclass(frozen=True)
class LayerPages:
    """Byte offsets of one layer's pages inside a block, and of its row inside a ring slot."""

    index: int
    name: str
    mla_offset: int
    indexer_offset: int
    ring_row_offset: int


class BlockLayout:
    """Offsets and sizes of the block and ring-block formats of one ``CacheConfig``."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.mla_page_bytes = config.mla.page_bytes
        family = config.family_spec
        self.indexer_page_bytes = family.page_bytes
        self.ring_slots = family.ring_slots
        self.ring_row_bytes = family.ring_row_bytes
        pages = []
        block_cursor = 0
        for index, name in enumerate(config.layer_names):
            mla_offset = block_cursor
            indexer_offset = _align(mla_offset + self.mla_page_bytes)
            block_cursor = _align(indexer_offset + self.indexer_page_bytes)
            pages.append(LayerPages(index, name, mla_offset, indexer_offset, index * self.ring_row_bytes))
        self.layers: tuple[LayerPages, ...] = tuple(pages)
        self.block_bytes = block_cursor
        self.block_planes: tuple[int, ...] = (block_cursor,)  # one plane: a block is one byte range
        self.ring_slot_bytes = self.ring_row_bytes * len(pages)
        self.ring_block_bytes = self.ring_slot_bytes * self.ring_slots
        self._by_name = {p.name: p for p in pages}

    def layer(self, key: int | str) -> LayerPages:
        """A layer's pages by index or by name (KeyError/IndexError naming the key)."""
        if isinstance(key, str):
            if key not in self._by_name:
                raise KeyError(f"no layer named {key!r}; layers are {list(self._by_name)}")
            return self._by_name[key]
        if not 0 <= key < len(self.layers):
            raise IndexError(f"layer index {key} out of range [0, {len(self.layers)})")
        return self.layers[key]

    @property
    def layout_hash(self) -> str:
        return layout_hash(self.config)

    def describe(self) -> dict[str, object]:
        """Plain description (sent in the connector's handshake and printed by the CLI)."""
        return self.config.hash_fields() | {
            "block_bytes": self.block_bytes,
            "ring_block_bytes": self.ring_block_bytes,
            "ring_slot_bytes": self.ring_slot_bytes,
            "layout_hash": self.layout_hash,
        }


def layout_hash(config: CacheConfig) -> str:
    """sha256 (hex) over every parameter that changes the bytes of a block or a ring block."""
    canonical = json.dumps(config.hash_fields(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def layout_differences(ours: dict[str, object], theirs: dict[str, object]) -> list[str]:
    """Names of the hashed fields whose values differ (the connector's refusal message)."""
    keys = sorted(set(ours) | set(theirs))
    return [k for k in keys if ours.get(k) != theirs.get(k)]
