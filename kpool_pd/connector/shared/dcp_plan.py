"""The transfer plan of one DCP decode rank: its own share of a prefilled request, and the whole ring.

A prefill node (not DCP) holds the request in global positions; rank r of a DCP decode instance
holds its own tokens in local positions (``kpool_pd.kvcache.dcp``). The rank's plan copies, for each run of
its tokens within the prompt:

- a whole block (every layer at once) where the run fills a block on both sides, or ends the
  prompt at the start of a block on both sides with nothing of the rank's after it: with the
  interleave a multiple of the block size (the default) that is every run, so the rank receives
  exactly its own blocks, as large regions;
- otherwise, per layer, the run's MLA bytes and the entries (fp8 bytes, then scales) of the pools
  it completes: an interleave smaller than a block costs more, smaller regions.

then the ring's live range, as ``plan_transfer`` moves it (every rank keeps the whole ring).
Both nodes compute the same plan from the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

from kpool_pd.connector.shared.plan import (PoolKind, Region, RegionPair, RingRange, TransferPlan, check_ids, plan_transfer,
                                   ring_live_range)
from kpool_pd.kvcache import BlockLayout, DcpConfig, DcpShard, FieldGeometry, FieldKind


def _layer_pairs(layout: BlockLayout, src: int, dst: int, t: int, u: int, count: int, pools: tuple[int, int, int]):
    """Per layer: ``count`` tokens at token ``t`` of source block ``src`` to token ``u`` of destination
    block ``dst``, and ``pools`` = (first source state, first destination state, how many) entries: every
    field's rows (``BlockLayout.fields``), in source byte order within the layer."""
    bb = layout.block_bytes
    s_state, d_state, entries = pools
    for layer in range(len(layout.layers)):
        spans = []
        for field in layout.fields:
            rows = (t, u, count) if field.kind is FieldKind.MLA else (s_state, d_state, entries)
            spans += _field_spans(field.heads_folded(), layer, *rows)
        for s, d, n in sorted(spans):
            yield RegionPair(Region(PoolKind.BLOCKS, src * bb + s, n), Region(PoolKind.BLOCKS, dst * bb + d, n))


def _field_spans(field: FieldGeometry, layer: int, s_row: int, d_row: int, rows: int) -> list[tuple[int, int, int]]:
    """(source offset, destination offset, bytes) spans inside a block of ``rows`` consecutive rows of
    ``field`` from row ``s_row`` to row ``d_row``, a span a head: split where a run crosses a page boundary
    on either side (a kpool kernel page: its entries, then their scales), a row each where a page's rows
    are not back to back."""
    spans, done, per_page = [], 0, field.rows_per_page
    while done < rows:
        s, d = s_row + done, d_row + done
        n = min(rows - done, per_page - s % per_page, per_page - d % per_page) if field.rows_contiguous else 1
        spans += [(field.offset(layer=layer, row=s, head=h), field.offset(layer=layer, row=d, head=h),
                   n * field.piece_bytes) for h in range(field.heads)]
        done += n
    return spans


def _merged(pairs: list[RegionPair]) -> list[RegionPair]:
    """Adjacent pairs contiguous on both sides become one."""
    out: list[RegionPair] = []
    for pair in pairs:
        if out:
            last = out[-1]
            if (last.src.kind is pair.src.kind and last.src.offset + last.src.nbytes == pair.src.offset
                    and last.dst.offset + last.dst.nbytes == pair.dst.offset):
                n = last.src.nbytes + pair.src.nbytes
                out[-1] = RegionPair(Region(pair.src.kind, last.src.offset, n), Region(pair.dst.kind, last.dst.offset, n))
                continue
        out.append(pair)
    return out


def plan_dcp_transfer(layout: BlockLayout, src_blocks: Sequence[int], dst_blocks: Sequence[int], src_ring: int,
                      dst_ring: int, live: RingRange, shard: DcpShard, prompt_len: int, *,
                      src_num_blocks: int | None = None, dst_num_blocks: int | None = None,
                      src_num_rings: int | None = None, dst_num_rings: int | None = None) -> TransferPlan:
    """Rank ``shard``'s share of a ``prompt_len``-token prompt held in ``src_blocks`` (the request's
    blocks in order) into ``dst_blocks`` (the rank's, ``shard.blocks_for_tokens(layout.config, prompt_len)`` of
    them), then the ring.
    ValueError naming the numbers for block lists of the wrong length or ids out of range."""
    config = layout.config
    block, kpool = config.block_size, config.tokens_per_entry
    if shard.interleave % kpool:
        raise ValueError(f"dcp interleave ({shard.interleave} tokens) must be a multiple of kpool ({kpool})")
    if len(src_blocks) != config.blocks_for_tokens(prompt_len):
        raise ValueError(f"a {prompt_len}-token prompt lies in {config.blocks_for_tokens(prompt_len)} blocks, "
                         f"got {len(src_blocks)} source blocks")
    need = shard.blocks_for_tokens(config, prompt_len)
    if len(dst_blocks) != need:
        raise ValueError(f"rank {shard.rank} of {shard.size} lands a {prompt_len}-token prompt in {need} blocks, "
                         f"got {len(dst_blocks)}")
    check_ids("source blocks", src_blocks, src_num_blocks)
    check_ids("destination blocks", dst_blocks, dst_num_blocks)
    # the ring checks and the ring's pieces are plan_transfer's (no blocks: nothing else is planned)
    ring_only = plan_transfer(layout, [], [], src_ring, dst_ring, live, src_num_rings=src_num_rings,
                              dst_num_rings=dst_num_rings)
    own_prompt = shard.owned_tokens(prompt_len)
    complete_end = prompt_len // kpool * kpool
    states = config.family_spec.entries_per_block
    bb = layout.block_bytes
    pairs: list[RegionPair] = []
    for first, length in shard.owned_runs(0, prompt_len):
        pos, end = first, first + length
        while pos < end:
            local = shard.local_position(pos)
            stop = min(end, (pos // block + 1) * block, pos + block - local % block)
            src, dst = src_blocks[pos // block], dst_blocks[local // block]
            t, u, count = pos % block, local % block, stop - pos
            whole = t == 0 and u == 0 and (count == block or (stop == prompt_len and local + count == own_prompt))
            if whole:
                pairs.append(RegionPair(Region(PoolKind.BLOCKS, src * bb, bb), Region(PoolKind.BLOCKS, dst * bb, bb)))
            else:
                entries = max(0, min(stop, complete_end) - pos) // kpool
                pools = ((pos // kpool) % states, (local // kpool) % states, entries)
                pairs.extend(_layer_pairs(layout, src, dst, t, u, count, pools))
            pos = stop
    return TransferPlan(pairs=tuple(_merged(pairs)) + ring_only.pairs, ring_empty=live.empty)


def dcp_transfer_bytes(layout: BlockLayout, prompt_len: int, dcp: DcpConfig) -> list[int]:
    """The bytes each rank of ``dcp`` receives for a ``prompt_len``-token prompt (one rank: the
    whole request's plan), for any block ids."""
    config = layout.config
    src = list(range(config.blocks_for_tokens(prompt_len)))
    live = ring_live_range(config, prompt_len)
    if dcp.size == 1:
        return [plan_transfer(layout, src, src, 0, 0, live).total_bytes]
    return [plan_dcp_transfer(layout, src, list(range(shard.blocks_for_tokens(config, prompt_len))), 0, 0, live, shard,
                              prompt_len).total_bytes for shard in dcp.shards()]
