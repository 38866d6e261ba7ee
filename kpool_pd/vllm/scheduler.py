"""The scheduler side of the connector (vLLM's engine core): which requests a producer offers as grants and
which a consumer loads, and the ``kv_transfer_params`` between them (NixlConnector's request protocol).

Producer (``kv_producer``): a request with ``{"do_remote_decode": true}`` is offered as a grant in the
step that computes its prompt's last token (the worker holds it once that step's forward ran, before the
step's output leaves the engine); ``request_finished`` then keeps its blocks (``delay_free``) until the
worker reports the grant ended (pulled and released, or its lease ran out) and returns the params the
decode request sends back. Consumer (``kv_consumer``): a request whose params say
``do_remote_prefill`` loads its prompt asynchronously into the blocks vLLM allocates for it.

Both take a request's blocks in every KV cache group that moves (``kpool_pd.vllm.groups``: the prompt's
blocks of a full-attention or MLA group, the in-window ones of a sliding-window group, the ring's one).

**Ranks.** A producer's params name every TP rank's address (``kpool_pd.vllm.rank_params``); a consumer
plans which producer ranks' grants each of its ranks pulls (``kpool_pd.vllm.ranks``). Each read grant is
renewed and, when it is not pulled, released by the consumer rank that reads it; a producer rank whose
whole grant no consumer rank pulls is released by rank 0 once the request's load ended on every rank
(vLLM's finished receiving), or at once when the request will not load.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

from kpool_pd.vllm.groups import GroupRule, cached_block_ids, held_indices, request_blocks
from kpool_pd.vllm.metadata import (KpoolPdMetadata, Load, Offer, Release, Renew, is_idle, is_remote_prefill,
                                    prefetch_target, producer_params, read_key, released_after_pull)
from kpool_pd.vllm.rank_params import RankParams
from kpool_pd.vllm.ranks import EngineRanks, RankPlan
from kpool_pd.transfer_params import DecodeParams, bounded_request_id, prompt_digest, release_target
from kpool_pd.vllm.settings import KpoolPdSettings

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# vLLM's RequestStatus names of a request that ends without its output reaching the client
UNANSWERED = frozenset({"FINISHED_ABORTED", "FINISHED_IGNORED", "FINISHED_ERROR"})


class ProducerScheduler:
    def __init__(self, settings: KpoolPdSettings, rules: tuple[GroupRule, ...], *, engine_id: str) -> None:
        self.settings, self.rules, self.engine_id = settings, rules, engine_id
        self.kv_cache_manager: "KVCacheManager | None" = None
        self.rank_addresses: tuple[str, ...] | None = None  # every TP rank's, as its worker reported it
        self._prefilling: dict[str, "Request"] = {}  # do_remote_decode requests whose prompt is not computed
        self._offered: dict[str, Offer] = {}  # offered in a step's metadata, not finished yet
        self._pending: list[Offer] = []
        self._withdrawn: list[str] = []  # offered requests that ended with no answer: their grants go

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and request.request_id not in self._offered:
            self._prefilling[request.request_id] = request

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KpoolPdMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, request in list(self._prefilling.items()):
            if request_id in scheduled and request.num_computed_tokens + scheduled[request_id] >= request.num_prompt_tokens:
                del self._prefilling[request_id]
                n = request.num_prompt_tokens
                try:
                    blocks = request_blocks(self.rules, self.kv_cache_manager.get_block_ids(request_id), n)
                except ValueError:
                    logger.exception("request %s is not offered: its blocks cannot be moved", request_id)
                    continue
                digest = prompt_digest(request.prompt_token_ids[:n], [len(group) for group in blocks])
                try:
                    prefetch_by = prefetch_target(request.kv_transfer_params)
                except ValueError as exc:
                    logger.warning("request %s is announced to no consumer: %s", request_id, exc)
                    prefetch_by = ""
                offer = Offer(request_id=bounded_request_id(request_id), grant_id=secrets.token_hex(16),
                              block_ids=blocks, prompt_len=n, prompt_digest=digest, prefetch_by=prefetch_by)
                self._offered[request_id] = offer
                self._pending.append(offer)
        meta = KpoolPdMetadata(offers=self._pending, withdrawals=self._withdrawn, idle=is_idle(scheduler_output))
        self._pending, self._withdrawn = [], []
        return meta

    def request_finished(self, request: "Request", block_ids) -> tuple[bool, dict[str, Any] | None]:
        """Blocks of an offered request stay until its grant ends (the worker reports it); the params
        name the grant. A request that was not offered (not a PD prefill, or it ended before its prompt
        was computed) frees at once, and so does an offered one that ended with no answer to its client
        (aborted, refused, failed: nobody holds its params): the next step's metadata withdraws its grants,
        which the workers do before that step's forward can write into the blocks."""
        self._prefilling.pop(request.request_id, None)
        offer = self._offered.pop(request.request_id, None)
        if offer is None:
            return False, None
        if request.status.name in UNANSWERED:
            self._withdrawn.append(offer.request_id)
            return False, None
        addresses = self.rank_addresses or (self.settings.advertise,)
        return True, producer_params(offer, address=addresses[0], engine_id=self.engine_id,
                                     lease_s=self.settings.lease_s, rank_addresses=addresses,
                                     released_after_pull=self.settings.release_after_pull)


class ConsumerScheduler:
    """Decides, for each decode request, whether its prompt is pulled (a ``Load``), or computed here and the
    producer's grant given back at once (a ``Release``): params that fail their checks, a prompt this
    engine's prefix cache already holds, a request vLLM rejected or aborted before its load began."""

    def __init__(self, settings: KpoolPdSettings, rules: tuple[GroupRule, ...],
                 ranks: EngineRanks = EngineRanks()) -> None:
        self.settings, self.rules, self.ranks = settings, rules, ranks
        self._after_load: dict[str, list[Release]] = {}  # releases due once a request's load ended on every rank
        self._loads: list[Load] = []
        self._releases: list[Release] = []
        self._renewals: list[Renew] = []
        self._loading: set[str] = set()  # requests whose Load went to the worker (the pull owns the grant)
        self._parsed: dict[str, tuple[DecodeParams, RankParams, RankPlan]] = {}  # queued requests' checked params

    def on_new_request(self, request: "Request") -> None:
        """A decode request joined vLLM's queue: the worker keeps its grant's lease alive while it waits
        (until its Load or its Release; the params are checked when the request is scheduled)."""
        params = request.kv_transfer_params
        if not is_remote_prefill(params):
            return
        try:
            decode, ranks, plan = self._parsed[request.request_id] = self._parse(params)
        except ValueError:
            return  # refused when it is scheduled
        for rank, reads in enumerate(plan.reads):
            self._renewals += [Renew(request_id=request.request_id, address=ranks.addresses[read.remote_rank],
                                     key=read_key(decode.key, read), lease_s=decode.lease_s, rank=rank)
                               for read in reads]

    def _checked(self, request: "Request") -> tuple[DecodeParams, RankParams, RankPlan]:
        """``_parse`` of the request's params, as ``on_new_request`` found them (parsed once a request)."""
        parsed = self._parsed.get(request.request_id)
        return parsed if parsed is not None else self._parse(request.kv_transfer_params)

    def _parse(self, params) -> tuple[DecodeParams, RankParams, RankPlan]:
        """The checked params, the producer's ranks and what this engine's ranks read of them; ValueError
        naming the field or the sizes."""
        decode = DecodeParams.parse(params)
        ranks = RankParams.parse(params)
        return decode, ranks, self.ranks.plan(ranks.tp_size)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """The prompt's tokens beyond this engine's prefix-cache hit (``num_computed_tokens``, whole blocks),
        loaded asynchronously, for a decode request whose params name a producer's grant: the load pulls
        only the blocks the hit lacks, and the ring. Otherwise (0, False), decided once: the params are
        marked loaded, and a grant they name is released."""
        params = request.kv_transfer_params
        if not is_remote_prefill(params):
            return 0, False
        try:
            decode, _, _ = self._checked(request)
        except ValueError as exc:
            logger.warning("request %s computes its prompt here: %s", request.request_id, exc)
            self._release(request, f"its kv_transfer_params were refused ({exc})")
            return 0, False
        count = min(decode.num_tokens, request.num_prompt_tokens)
        if num_computed_tokens >= count:
            self._release(request, f"all {count} of its tokens are in this engine's prefix cache")
            return 0, False
        return count - num_computed_tokens, True

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if num_external_tokens > 0 and is_remote_prefill(params):
            decode, ranks, plan = self._checked(request)  # checked by get_num_new_matched_tokens
            self._parsed.pop(request.request_id, None)
            tables = blocks.get_block_ids()
            count = min(decode.num_tokens, request.num_prompt_tokens)  # the hit's tokens and num_external_tokens
            try:
                dst = request_blocks(self.rules, tables, count)
                digest = prompt_digest(request.prompt_token_ids[:count], [len(group) for group in dst])
                error = "" if digest == decode.prompt_digest else (
                    f"its prompt ({count} tokens) is not the one the producer's grant holds (the "
                    "prompt digests differ)")
                load = Load(request_id=request.request_id, params=decode, block_ids=dst, digest=digest, error=error,
                            held=held_indices(self.rules, dst, cached_block_ids(blocks)), ranks=ranks,
                            released_after_pull=released_after_pull(params))
            except ValueError as exc:  # the worker reports the load failed
                load = Load(request_id=request.request_id, params=decode, block_ids=tuple(tuple(t) for t in tables),
                            digest=decode.prompt_digest, error=str(exc), ranks=ranks)
            self._loads.append(load)
            self._after_load[request.request_id] = [
                Release(request_id=request.request_id, address=ranks.addresses[rank], key=decode.key,
                        why="no rank of this engine pulls its whole grant") for rank in plan.unread]
            self._loading.add(request.request_id)
            params["do_remote_prefill"] = False  # loaded once: a second allocation for this request loads nothing

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """vLLM's scheduler, every step: the requests whose load ended on every rank release the producer
        ranks no rank of this engine pulled whole."""
        for request_id in output.finished_recving or ():
            self._releases += self._after_load.pop(request_id, [])

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KpoolPdMetadata:
        meta = KpoolPdMetadata(loads=self._loads, releases=self._releases, renewals=self._renewals,
                               idle=is_idle(scheduler_output))
        self._loads, self._releases, self._renewals = [], [], []
        return meta

    def request_finished(self, request: "Request", block_ids) -> tuple[bool, dict[str, Any] | None]:
        """A request whose load began: the pull releases its grant. One that never loaded (rejected before
        the engine, aborted while it waited, failed): its grant is released now."""
        self._parsed.pop(request.request_id, None)
        if request.request_id in self._loading:
            self._loading.discard(request.request_id)
            return False, None
        if is_remote_prefill(request.kv_transfer_params):
            self._release(request, f"it ended ({request.status.name}) before its load began")
        return False, None

    def _release(self, request: "Request", why: str) -> None:
        """The request loads nothing from now on; the grants its params name (if they name any) are released:
        each rank's read grants by that rank, the producer ranks none of them pulls whole by rank 0."""
        params = request.kv_transfer_params
        try:
            decode, ranks, plan = self._checked(request)
        except ValueError:
            target = release_target(params)
            if target is not None:
                self._releases.append(Release(request_id=request.request_id, address=target[0], key=target[1], why=why))
        else:
            rid = request.request_id
            self._releases += [Release(request_id=rid, address=ranks.addresses[read.remote_rank],
                                       key=read_key(decode.key, read), why=why, rank=rank)
                               for rank, reads in enumerate(plan.reads) for read in reads]
            self._releases += [Release(request_id=rid, address=ranks.addresses[p], key=decode.key, why=why)
                               for p in plan.unread]
        params["do_remote_prefill"] = False
        self._parsed.pop(request.request_id, None)
