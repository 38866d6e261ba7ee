"""The connector's ids of a request's blocks in a pool of **head units**, and of the slots a rank reads.

A pool of head units (``kpool_pd.vllm.planes.engine_pool`` with ``head_units``) names one KV head slot of
one vLLM block per id: slot ``h`` of vLLM block ``b`` of group ``g`` is unit ``b * units + h`` of group
``g`` (``units``: the head slots a rank holds in each block), the connector's id
``layout.block_id(g, b * units + h)``. A pool of whole blocks is the case ``units == 1``. A rank's whole
grant names every slot of a request's blocks (a run of consecutive blocks stays one run of ids); a slot
grant names one slot of each block.
"""

from __future__ import annotations

from collections.abc import Sequence

BlockIds = tuple[tuple[int, ...], ...]  # one tuple of vLLM block ids per KV cache group


def unit_ids(layout, block_ids: BlockIds, *, units: int, slots: Sequence[int]) -> tuple[int, ...]:
    """The connector's ids of slots ``slots`` (in that order) of every block of ``block_ids`` (per group, in
    block-table order), group by group; ``layout`` a ``PlanarLayout`` of ``units`` head slots a block.
    ValueError naming the slot for a slot outside ``[0, units)`` or a table count that is not the layout's."""
    if type(units) is not int or units < 1:
        raise ValueError(f"units must be a positive integer, got {units!r}")
    bad = [s for s in slots if type(s) is not int or not 0 <= s < units]
    if bad or not slots:
        raise ValueError(f"head slots {list(slots)} of a block of {units} slots")
    if len(block_ids) > layout.num_groups:
        raise ValueError(f"{len(block_ids)} block tables for a layout of {layout.num_groups} KV cache groups")
    return tuple(layout.block_id(group, b * units + s) for group, blocks in enumerate(block_ids)
                 for b in blocks for s in slots)
