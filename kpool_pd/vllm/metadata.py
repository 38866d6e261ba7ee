"""What the scheduler side tells the worker side each step (vLLM's ``KVConnectorMetadata``), and the
``kv_transfer_params`` a producer hands out for its consumers (NixlConnector's request protocol).

Block ids travel per KV cache group, as vLLM keeps them (one tuple per group, vLLM's group order; the
groups not moved are empty); ``remote_block_ids`` is a list of lists, as NixlConnector's. The connector
names a block by one id (``kvcache.PlanarLayout.block_id``): ``flat_ids`` lists a request's blocks that
way, group by group. With TP ranks, a Load names the producer's ranks (``RankParams``) and each worker
pulls its own reads (``kpool_pd.vllm.ranks``); a Release or a Renew names the worker rank that sends it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kpool_pd.connector import PrefillGrant, RingRange
from kpool_pd.transfer_params import MAX_ID_CHARS, DecodeParams, grant_key
from kpool_pd.kvcache import PlanarLayout
from kpool_pd.vllm.rank_params import ADDRESSES_FIELD, TP_FIELD, RankParams
from kpool_pd.vllm.ranks import Read, slot_key
from kpool_pd.vllm.units import unit_ids

BlockIds = tuple[tuple[int, ...], ...]  # one tuple of vLLM block ids per KV cache group


@dataclass(frozen=True, kw_only=True)
class Offer:
    """Producer: request ``request_id``'s prompt is computed by the end of this step in ``block_ids``
    (per group); hold them as grant ``grant_id``."""

    request_id: str
    grant_id: str
    block_ids: BlockIds
    prompt_len: int
    prompt_digest: str  # ``kpool_pd.transfer_params.prompt_digest`` of the prompt and ``block_ids``' counts
    prefetch_by: str = ""  # the connector's engine id of the consumer the request's params named (``prefetch_by``)

    @property
    def key(self) -> str:
        """The id the producer's connector holds the grant under (bound to the prompt)."""
        return grant_key(self.grant_id, self.prompt_digest)


PREFETCH_FIELD = "prefetch_by"  # a producer request's: the vLLM engine_id of the consumer its decode request goes to


def connector_engine_id(vllm_engine_id: str) -> str:
    """The id a vLLM engine's connector presents to producers (``kv_transfer_config.engine_id``, prefixed)."""
    return f"vllm-{vllm_engine_id}"


def prefetch_target(params) -> str:
    """The connector engine id a producer request's params name in ``prefetch_by`` ("" for none); ValueError for a
    value that is not a non-empty string of at most MAX_ID_CHARS characters."""
    if not isinstance(params, dict) or PREFETCH_FIELD not in params:
        return ""
    value = params[PREFETCH_FIELD]
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS - 5:
        raise ValueError(f"kv_transfer_params[{PREFETCH_FIELD!r}] must be a consumer's vLLM engine_id (a string of "
                         f"1 to {MAX_ID_CHARS - 5} characters), got {str(value)[:64]!r}")
    return connector_engine_id(value)


@dataclass(frozen=True, kw_only=True)
class Load:
    """Consumer: pull the grant of ``params`` into ``block_ids`` (vLLM's blocks for request ``request_id``,
    per group; those at the indices ``held`` are this engine's prefix-cache hit and are not pulled), the grant
    named by ``digest``, this request's own prompt digest. ``error``: why the prompt
    cannot land in them (the load fails, as vLLM's ``kv_load_failure_policy`` says, and the grant is
    released)."""

    request_id: str
    params: DecodeParams
    block_ids: BlockIds
    digest: str
    error: str = ""
    held: tuple[int, ...] = ()  # indices into ``flat_ids(block_ids)`` of the blocks this engine's prefix cache holds
    ranks: RankParams | None = None  # the producer's ranks (None: one, at ``params.address``)
    released_after_pull: bool = False  # the producer frees a grant once a pull sent it all: no Release after it

    @property
    def producer_ranks(self) -> RankParams:
        return self.ranks or RankParams(tp_size=1, addresses=(self.params.address,))


@dataclass(frozen=True, kw_only=True)
class Release:
    """Consumer: the producer's grant of ``params`` will not be pulled (the request was rejected, aborted,
    or its prompt is in this engine's cache): give its blocks back now rather than at its lease's end."""

    request_id: str
    address: str  # the producer's, as the params named it (the worker checks it is allowed)
    key: str  # the grant's key on the producer
    why: str
    rank: int = 0  # the worker rank that sends it (the one that reads the grant, or rank 0)


@dataclass(frozen=True, kw_only=True)
class Renew:
    """Consumer: request ``request_id`` waits in vLLM's queue for the producer's grant ``key`` at ``address``:
    keep the grant's lease alive until its load or its release begins, however long the queue."""

    request_id: str
    address: str
    key: str
    lease_s: float  # the producer's lease (renewed at a third of it)
    rank: int = 0  # the worker rank that renews it (the one that will pull it)


@dataclass
class KpoolPdMetadata(KVConnectorMetadata):
    offers: list[Offer] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)
    renewals: list[Renew] = field(default_factory=list)
    withdrawals: list[str] = field(default_factory=list)  # offered requests that ended unanswered (aborted)
    idle: bool = False  # the step schedules no token: vLLM steps only to hear about transfers


def is_idle(scheduler_output) -> bool:
    """A step that schedules no token (vLLM steps on while requests wait on transfers)."""
    return scheduler_output.total_num_scheduled_tokens == 0


RELEASED_AFTER_PULL_FIELD = "remote_released_after_pull"  # true: the producer frees a grant its pull sent whole


def producer_params(offer: Offer, *, address: str, engine_id: str, lease_s: float,
                    rank_addresses: Sequence[str] | None = None, released_after_pull: bool = False) -> dict:
    """The prefill request's output ``kv_transfer_params``: what the decode request sends back.
    ``rank_addresses``: every TP rank's address, rank 0's first (``kpool_pd.vllm.rank_params``);
    ``released_after_pull``: the producer frees each grant as soon as a pull has sent it all (its settings'
    ``release_after_pull``), so that the consumer sends no Release after a pull."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
              "remote_address": address, "remote_request_id": offer.request_id, "remote_grant_id": offer.grant_id,
              "remote_prompt_digest": offer.prompt_digest, "remote_block_ids": [list(group) for group in offer.block_ids],
              "remote_num_tokens": offer.prompt_len, "remote_lease_ms": int(lease_s * 1000)}
    if rank_addresses is not None:
        params |= {TP_FIELD: len(rank_addresses), ADDRESSES_FIELD: list(rank_addresses)}
    if released_after_pull:
        params[RELEASED_AFTER_PULL_FIELD] = True
    return params


def released_after_pull(params) -> bool:
    """Whether a decode request's params say its producer frees a grant once a pull has sent it all."""
    return isinstance(params, dict) and params.get(RELEASED_AFTER_PULL_FIELD) is True


def is_remote_prefill(params) -> bool:
    """A decode request that says its prompt waits on a producer (its params not checked yet)."""
    return isinstance(params, dict) and params.get("do_remote_prefill") is True


def flat_ids(layout: PlanarLayout, block_ids: BlockIds) -> tuple[int, ...]:
    """The connector's ids of ``block_ids`` (per group), group by group in block-table order."""
    if len(block_ids) != layout.num_groups:
        raise ValueError(f"{len(block_ids)} block tables for a layout of {layout.num_groups} KV cache groups")
    return tuple(layout.block_id(group, b) for group, blocks in enumerate(block_ids) for b in blocks)


def read_key(key: str, read: Read) -> str:
    """The key of the grant ``read`` pulls from a producer rank that holds the request as ``key``."""
    return key if read.whole else slot_key(key, read.remote_slots[0])


def rank_grant(params: DecodeParams, digest: str, layout: PlanarLayout, dst: BlockIds, read: Read, *,
               local_units: int, remote_units: int) -> tuple[PrefillGrant, tuple[int, ...]]:
    """The grant ``params`` name for one read of a TP rank, under the key of ``digest`` (this request's own
    prompt digest): the producer rank's grant ``read`` names (its whole grant or one slot's), its ids
    (``remote_units`` head slots a block) and the ids of this rank's slots of ``dst`` (this engine's blocks per
    group, ``local_units`` slots a block) they land in, one for each of the producer's. ValueError naming the
    group for a group whose block counts differ."""
    src = params.block_ids
    if len(src) != len(dst):
        raise ValueError(f"the producer has {len(src)} KV cache groups, this engine {len(dst)}")
    for group, (theirs, ours) in enumerate(zip(src, dst)):
        if len(theirs) != len(ours):
            raise ValueError(f"group {group}: the producer offers {len(theirs)} blocks, this engine holds "
                             f"{len(ours)} for them")
    src_ids = unit_ids(layout, src, units=remote_units, slots=read.remote_slots)
    key = read_key(grant_key(params.grant_id, digest), read)
    grant = PrefillGrant(grant_id=key, request_id=params.request_id or "vllm", prompt_len=params.num_tokens,
                         num_blocks=len(src_ids), ring_live=RingRange(0, 0), first_token=0, lease_s=params.lease_s,
                         src_block_ids=src_ids, src_ring_id=0)
    return grant, unit_ids(layout, dst, units=local_units, slots=read.local_slots)
