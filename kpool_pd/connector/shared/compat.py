"""Which peers a node can exchange blocks with: the same model (``model_differences``), and a block
layout that stores the same cache, differing at most in the fields that only arrange bytes
(``ARRANGING_FIELDS``: the block size, the block order, the kernel page), which the decode node
converts with ``kernels.repack_tokens`` (DESIGN, "Heterogeneous P/D")."""

from __future__ import annotations

import json
from dataclasses import replace

from kpool_pd.connector import prefill_api as pb
from kpool_pd.kvcache import KERNEL_PAGE_STATES, BlockLayout, BlockOrder, CacheFamily, layout_differences

MAX_MODEL_IDENTITY_CHARS = 4096
# The hashed layout fields that arrange the bytes without changing what they mean: block size and
# order, and what follows from the block size and the kernel page (states per block and per page).
ARRANGING_FIELDS = frozenset({"block_size", "order", "states_per_block", "states_per_page"})


def peer_layout(ours: BlockLayout, theirs: pb.Layout) -> tuple[BlockLayout | None, list[str]]:
    """The peer's layout and the hashed fields that differ from ours.

    ``(ours, [])`` when the hashes match; ``(their layout, fields)`` when only arranging fields
    differ (``ARRANGING_FIELDS``) and their hash and sizes are exactly what our config with their
    block size, order and a kernel page of 32 or 64 states gives; ``(None, fields)`` otherwise (the
    fields name every difference, for FAILED_PRECONDITION).
    """
    if theirs.layout_hash == ours.layout_hash:
        return ours, []
    try:
        fields = json.loads(theirs.fields_json or "{}")
    except json.JSONDecodeError:
        fields = None
    if not isinstance(fields, dict):
        return None, ["<unreadable>"]
    differing = layout_differences(ours.config.hash_fields(), fields)
    meaningful = [name for name in differing if name not in ARRANGING_FIELDS]
    if meaningful or not differing:
        return None, meaningful or ["layout_hash"]
    layout = _arranged_like(ours, fields)
    if layout is None or (layout.block_bytes, layout.ring_block_bytes) != (theirs.block_bytes, theirs.ring_block_bytes) \
            or layout.layout_hash != theirs.layout_hash:
        return None, [*differing, "layout_hash"]
    return layout, differing


def _arranged_like(ours: BlockLayout, fields: dict) -> BlockLayout | None:
    """Our config with the peer's block size, order and kernel page (the one of 32 or 64 states
    whose hash matches theirs, ours first), or None when no such config exists."""
    try:
        order, block_size = BlockOrder(fields["order"]), fields["block_size"]
    except (KeyError, ValueError, TypeError):
        return None
    if type(block_size) is not int:
        return None
    pages = (ours.config.kernel_page_states, *(p for p in KERNEL_PAGE_STATES if p != ours.config.kernel_page_states))
    for page in pages:
        try:
            layout = BlockLayout(replace(ours.config, order=order, block_size=block_size, kernel_page_states=page))
        except ValueError:
            continue
        if layout.config.hash_fields() == fields:
            return layout
    return None


def arrangement(layout: BlockLayout) -> str:
    """The arranging fields of a layout in words: ``"256-token BLNHC blocks (64-state kernel pages)"``."""
    config = layout.config
    pages = f" ({config.kpool_indexer.states_per_page}-state kernel pages)" if config.family is CacheFamily.KPOOL else ""
    return f"{config.block_size}-token {config.order.value} blocks{pages}"


def model_differences(ours: str, theirs: str) -> list[str]:
    """What differs between two model identities, ours first: ``[]`` when they are equal, else one
    entry per field when both are JSON objects (``"seed 1 vs 2"``), else the two identities.

    The identity is opaque to the connector (a daemon gives it, e.g. ``ModelConfig.identity()``,
    the canonical JSON of every model field that changes tokens or bytes); an empty one is "no
    model named", which matches only another empty one."""
    if ours == theirs:
        return []
    if not ours or not theirs:
        return [f"identity {_short(ours) if ours else '(none)'} vs {_short(theirs) if theirs else '(none)'}"]
    mine, other = _object(ours), _object(theirs)
    if mine is None or other is None:
        return [f"identity {_short(ours)} vs {_short(theirs)}"]
    missing = object()
    return [f"{key} {_value(mine.get(key, missing), missing)} vs {_value(other.get(key, missing), missing)}"
            for key in sorted(set(mine) | set(other)) if mine.get(key, missing) != other.get(key, missing)] \
        or [f"identity {_short(ours)} vs {_short(theirs)}"]


def _object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _value(value, missing) -> str:
    return "(none)" if value is missing else json.dumps(value)[:64]


def _short(text: str) -> str:
    return repr(text if len(text) <= 64 else text[:61] + "...")
