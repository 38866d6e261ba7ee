"""Pairs of layouts that arrange the same cache otherwise (block size, block order, kernel page), by name, for
the tests of pulls between them (``tests/connector/test_connector_arrangement.py``, its GPU counterparts)."""

from __future__ import annotations

import dataclasses

from kpool_pd.kvcache import CacheConfig
from tests.support import connector_procs as procs

# (cache, prefill (order, block size, kernel page), decode (...)): kpool 4 with 3 drafts (ring 8) and two
# MLA heads, kpool 2 (states of a 128-token block fill a 64-state page; 256 tokens make two pages, or four
# of 32), QSA ratio 4 with two heads.
ARRANGEMENTS = {
    "kpool-32-to-64": ("kpool-2heads", ("BLNHC", 32, None), ("BLNHC", 64, None)),
    "kpool-128-to-32-blhnc": ("kpool-2heads", ("BLNHC", 128, None), ("BLHNC", 32, None)),
    "kpool-64-to-128": ("kpool-2heads", ("BLHNC", 64, None), ("BLNHC", 128, None)),
    "kpool-64-to-192": ("kpool-2heads", ("BLNHC", 64, None), ("BLNHC", 192, None)),
    "kpool2-128-to-256-two-pages": ("kpool2", ("BLNHC", 128, None), ("BLNHC", 256, None)),
    "kpool2-256-to-256-page32": ("kpool2", ("BLNHC", 256, 64), ("BLNHC", 256, 32)),
    "qsa-16-to-32": ("qsa-2heads", ("BLNHC", 16, None), ("BLNHC", 32, None)),
    "qsa-64-to-16-blhnc": ("qsa-2heads", ("BLHNC", 64, None), ("BLNHC", 16, None)),
    "qsa-order-only": ("qsa-2heads", ("BLNHC", 32, None), ("BLHNC", 32, None)),
    "qsa-same": ("qsa-2heads", ("BLHNC", 32, None), ("BLHNC", 32, None)),
}


def arranged(name: str, order: str = "BLNHC", block_size: int | None = None, page: int | None = None) -> CacheConfig:
    """The test cache ``name`` (``connector_procs.CONFIGS``) in ``order``, with another block size or kernel page."""
    config = procs.make_config(name, order)
    return dataclasses.replace(config, block_size=block_size or config.block_size,
                               kernel_page_states=page or config.kernel_page_states)


def arrangement_configs(name: str) -> dict[str, CacheConfig]:
    """``InProcessPair``'s ``prefill_config`` and ``decode_config`` for the arrangement ``name``."""
    cache, prefill_side, decode_side = ARRANGEMENTS[name]
    return {"prefill_config": arranged(cache, *prefill_side), "decode_config": arranged(cache, *decode_side)}
