"""Which peers a node can exchange blocks with: the same model (``model_differences``), and its
own layout or one that differs only in ``order`` (BLNHC / BLHNC), which the decode node converts
with ``kernels.repack_blocks``."""

from __future__ import annotations

import json
from dataclasses import replace

from connector import prefill_api as pb
from kvcache import BlockLayout, BlockOrder, layout_differences

MAX_MODEL_IDENTITY_CHARS = 4096


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
