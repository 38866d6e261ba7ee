"""What a decode node plans for a push (``PrefillPush``), before any block is allocated on the prefill node: the
grant the prompt will make there, where its blocks land here, and the plan, whose source side is relative to
that grant (``kpool_pd.connector.prefill.pushed_plan`` binds it to the blocks allocated there).

A prompt of ``n`` tokens fills ``blocks_for_tokens(n)`` blocks in the prefill node's block size and leaves a
known range of ring slots live, whatever blocks the engine allocates; so the plan of a pull (``WholeRequest``),
made with the grant's block-table indices 0..k-1 and ring 0 as its source ids, names each source region by its
place in the grant. It is split into pieces of ``piece_tokens`` (each moves once the prompt's chunks wrote it).
Only layouts of one block table a request push (several tables a request leave the block count to the engine).
"""

from __future__ import annotations

from kpool_pd.connector.decode.grant import PrefillGrant
from kpool_pd.connector.decode.inbound import Landing
from kpool_pd.connector.decode.share import WHOLE_REQUEST, PullTarget
from kpool_pd.connector.decode.staging import RepackStaging
from kpool_pd.connector.shared.plan import TransferPlan, ring_live_range
from kpool_pd.kvcache import BlockLayout, CacheAllocation, CachePool


def can_push(ours: BlockLayout, peer_layout: BlockLayout) -> bool:
    """Whether a pull between these layouts can be planned before the prefill node allocates."""
    return ours.num_groups == 1 and peer_layout.num_groups == 1


def plan_push(pool: CachePool, peer_layout: BlockLayout, allocation: CacheAllocation, *, request_id: str,
              prompt_len: int, lease_s: float, piece_tokens: int,
              buffers: RepackStaging | None = None) -> tuple[PrefillGrant, Landing, TransferPlan]:
    """The grant a ``prompt_len``-token prompt will make on the prefill node (its ids relative: block-table indices
    and ring 0; ``grant_id`` empty until it is made), where it lands in ``allocation`` (its first blocks and its
    ring, through staging when ``peer_layout`` arranges the cache otherwise), and the plan. ValueError for layouts
    that cannot push, or an allocation too small (naming both counts)."""
    ours = pool.layout
    if not can_push(ours, peer_layout):
        raise ValueError(f"a push needs one block table a request on both sides; this node keeps {ours.num_groups}, "
                         f"the prefill node {peer_layout.num_groups}")
    source_blocks = peer_layout.config.blocks_for_tokens(prompt_len)
    grant = PrefillGrant(grant_id="", request_id=request_id, prompt_len=prompt_len, num_blocks=source_blocks,
                         ring_live=ring_live_range(peer_layout.config, prompt_len), first_token=0, lease_s=lease_s,
                         src_block_ids=tuple(range(source_blocks)), src_ring_id=0, pipelined=True,
                         piece_blocks=max(1, piece_tokens // peer_layout.config.block_size))
    landed = WHOLE_REQUEST.blocks_landed(ours, grant)
    if allocation.num_blocks < landed:
        raise ValueError(f"push of {request_id} lands in {landed} blocks; the allocation holds {allocation.num_blocks}")
    ring_id = 0 if allocation.ring_id is None else allocation.ring_id  # a ringless layout's: names nothing
    landing = Landing(pool, peer_layout, allocation.block_ids[:landed], source_blocks=source_blocks,
                      num_tokens=prompt_len, buffers=buffers)
    target = PullTarget(layout=ours, peer_layout=peer_layout, block_ids=landing.ids, ring_id=ring_id,
                        num_blocks=landing.num_blocks, num_rings=pool.num_rings)
    return grant, landing, WHOLE_REQUEST.plan(grant, target, ())
