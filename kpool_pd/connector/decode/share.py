"""What one pull lands of a grant, and its plan: the whole request (a decode node of one rank) or one DCP
rank's share of it. The caller picks the share once (a DCP rank knows its shard from its start) and hands
it to every ``PrefillPeer.pull``; the peer and the pull ask it, never which kind it is.

Both shares count blocks through the decode node's own cache config (``CacheConfig.blocks_for_tokens``,
``DcpShard.blocks_for_tokens``) and plan with the peer's layout; a share plans once, and the plan is what
the pull request carries (``kpool_pd.connector.decode.inbound``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kpool_pd.connector.decode.grant import PrefillGrant
from kpool_pd.connector.shared.compat import arrangement
from kpool_pd.connector.shared.dcp_plan import plan_dcp_transfer
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.connector.shared.plan import TransferPlan, plan_transfer, without_held
from kpool_pd.kvcache import BlockLayout, DcpShard


@dataclass(frozen=True)
class PullTarget:
    """Where a pull lands: ``layout`` ours, ``peer_layout`` the prefill node's, ``block_ids`` the ids the
    plan names on our side (our blocks, or staging blocks 0..n-1 when the layouts are arranged otherwise),
    ``ring_id`` our ring, and the bounds of our ids (``num_blocks``, ``num_rings``)."""

    layout: BlockLayout
    peer_layout: BlockLayout
    block_ids: tuple[int, ...]
    ring_id: int
    num_blocks: int
    num_rings: int


class PullShare(abc.ABC):
    """What of a grant one pull lands. ``rank``: the DCP rank that pulls and releases it (0 for a whole
    request)."""

    rank: int = 0

    @abc.abstractmethod
    def blocks_landed(self, ours: BlockLayout, grant: PrefillGrant) -> int:
        """How many of the allocation's first blocks the prompt (this share of it) lands in."""

    @abc.abstractmethod
    def check(self, grant: PrefillGrant, *, ours: BlockLayout, peer_layout: BlockLayout, held: Sequence[int],
              address: str) -> None:
        """Before anything is sent: ValueError for held blocks this share cannot skip, StatusError
        FAILED_PRECONDITION for a peer whose layout this share cannot pull from."""

    @abc.abstractmethod
    def plan(self, grant: PrefillGrant, target: PullTarget, held: Sequence[int]) -> TransferPlan:
        """The pull's one plan (ValueError for ids out of range or counts that disagree with the grant)."""


class WholeRequest(PullShare):
    """A decode node of one rank pulls the whole prompt: into our block size (through staging and a repack
    where the peer's layout is arranged otherwise), skipping blocks we hold already (a prefix hit)."""

    def blocks_landed(self, ours: BlockLayout, grant: PrefillGrant) -> int:
        if ours.num_groups > 1:  # several block tables a request: one of ours per source block, as the engine chose
            return len(grant.src_block_ids)
        return ours.config.blocks_for_tokens(grant.prompt_len)

    def check(self, grant: PrefillGrant, *, ours: BlockLayout, peer_layout: BlockLayout, held: Sequence[int],
              address: str) -> None:
        if held and (grant.pipelined or peer_layout.layout_hash != ours.layout_hash):
            raise ValueError(f"pull of {grant.request_id}: held blocks are skipped only in a pull of a computed "
                             f"prompt from a prefill node of our layout, without DCP")

    def plan(self, grant: PrefillGrant, target: PullTarget, held: Sequence[int]) -> TransferPlan:
        if len(grant.src_block_ids) != len(target.block_ids):
            raise ValueError(f"grant of {len(grant.src_block_ids)} source blocks for {len(target.block_ids)} "
                             f"destination blocks")
        src, dst = without_held(grant.src_block_ids, target.block_ids, held)
        return plan_transfer(target.peer_layout, src, dst, grant.src_ring_id, target.ring_id, grant.ring_live,
                             dst_num_blocks=target.num_blocks, dst_num_rings=target.num_rings,
                             piece_blocks=grant.piece_blocks)

    def __repr__(self) -> str:
        return "WholeRequest()"


class RankShare(PullShare):
    """Rank ``shard.rank`` of a DCP decode instance pulls its own tokens and pools of the prompt and the whole
    ring (``kpool_pd.connector.shared.dcp_plan``), from a prefill node of its own layout."""

    def __init__(self, shard: DcpShard) -> None:
        self.shard = shard
        self.rank = shard.rank

    def blocks_landed(self, ours: BlockLayout, grant: PrefillGrant) -> int:
        return self.shard.blocks_for_tokens(ours.config, grant.prompt_len)

    def check(self, grant: PrefillGrant, *, ours: BlockLayout, peer_layout: BlockLayout, held: Sequence[int],
              address: str) -> None:
        if held:
            raise ValueError(f"pull of {grant.request_id}: held blocks are skipped only in a pull of a computed "
                             f"prompt from a prefill node of our layout, without DCP")
        if peer_layout.layout_hash != ours.layout_hash:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"a DCP rank pulls only from a prefill node of "
                              f"its own block layout; {address} stores {arrangement(peer_layout)}, "
                              f"this rank {arrangement(ours)}")

    def plan(self, grant: PrefillGrant, target: PullTarget, held: Sequence[int]) -> TransferPlan:
        return plan_dcp_transfer(target.layout, list(grant.src_block_ids), list(target.block_ids),
                                 grant.src_ring_id, target.ring_id, grant.ring_live, self.shard, grant.prompt_len,
                                 dst_num_blocks=target.num_blocks, dst_num_rings=target.num_rings)

    def __repr__(self) -> str:
        return f"RankShare({self.shard})"


WHOLE_REQUEST = WholeRequest()
