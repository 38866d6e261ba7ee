"""Which peer layouts a node can exchange blocks with: its own, or one that differs only in
``order`` (BLNHC / BLHNC), which the decode node converts with ``kernels.repack_blocks``."""

from __future__ import annotations

import json
from dataclasses import replace

from connector import prefill_api as pb
from kvcache import BlockLayout, BlockOrder, layout_differences


def peer_layout(ours: BlockLayout, theirs: pb.Layout) -> tuple[BlockLayout | None, list[str]]:
    """The peer's layout and the hashed fields that differ from ours.

    ``(ours, [])`` when the hashes match; ``(their layout, ["order"])`` when only the order
    differs and their hash and sizes are exactly what our config in their order gives;
    ``(None, fields)`` otherwise (the fields name every difference, for FAILED_PRECONDITION).
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
    if differing != ["order"]:
        return None, differing or ["layout_hash"]
    try:
        order = BlockOrder(fields["order"])
    except (ValueError, TypeError):
        return None, ["order"]
    layout = BlockLayout(replace(ours.config, order=order))
    if (layout.layout_hash, layout.block_bytes, layout.ring_block_bytes) != \
            (theirs.layout_hash, theirs.block_bytes, theirs.ring_block_bytes):
        return None, ["order", "layout_hash"]
    return layout, differing
