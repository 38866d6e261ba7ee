"""``KpoolPdConnector``: kpool-pd as vLLM's KV connector (``KVConnectorBase_V1``), loaded with
``--kv-transfer-config '{"kv_connector": "KpoolPdConnector", "kv_connector_module_path": "kpool_pd.vllm",
"kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_connector_extra_config": {...}}'`` (``kpool_pd.vllm.settings``).

vLLM makes one instance per role: the scheduler side (``kpool_pd.vllm.scheduler``) in its engine core
and the worker side (``kpool_pd.vllm.producer_worker``, ``kpool_pd.vllm.consumer_worker``) beside the KV
tensors; this class routes each of vLLM's calls to the part of the role it was made for. A ``kv_both``
instance has a producer and a consumer part on each side: it offers the requests that say ``do_remote_decode`` and pulls those that say
``do_remote_prefill``, as NixlConnector allows. It moves every KV cache group vLLM transfers, and keeps
vLLM's hybrid KV cache manager on (``SupportsHMA``): full-attention and MLA groups (``tokens_per_state``
pages too: GLM-5-Next's indexer, QSA's compressed keys) by the prompt's blocks, sliding-window groups by
the blocks in the window, per-request rings (``CircularBufferSpec``: GLM-5-Next's tail, QSA's key-state
ring, drafts' slots included) whole (``kpool_pd.vllm.groups``). A model with a group it cannot move
(e.g. Mamba state, chunked-local attention, a host-resident group) is refused with a ValueError naming
the group and why, when the scheduler side is made and when the worker side registers the caches.

**Ranks** (``kpool_pd.vllm.ranks``). Every worker rank serves its own pulls: TP rank ``r`` of DP rank
``d`` serves on the ``listen`` port plus ``d * tp_size + r``, and reports the address consumers dial
(``get_handshake_metadata``) to the scheduler side (``set_xfer_handshake_metadata``), whose
``kv_transfer_params`` then name every rank (``kpool_pd.vllm.rank_params``). A consumer's ranks read
the producer's by vLLM's rules for heterogeneous TP; it asks vLLM for the ``LBHNC`` KV cache layout
(``get_required_kvcache_layout``), as NixlConnector does, in which each head slot of a block moves on its
own. Pipeline parallelism is refused (a rank would hold some layers only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kpool_pd.vllm.groups import sharding_of, transfer_rules
from kpool_pd.vllm.metadata import connector_engine_id
from kpool_pd.vllm.planes import engine_pool, head_units
from kpool_pd.vllm.ranks import EngineRanks, RankSeat, Sharding
from kpool_pd.vllm.scheduler import ConsumerScheduler, ProducerScheduler
from kpool_pd.vllm.settings import KpoolPdSettings, KvLayout
from kpool_pd.vllm.stats import KpoolPdPromMetrics, KpoolPdStats
from kpool_pd.vllm.consumer_worker import ConsumerWorker
from kpool_pd.vllm.loop import TransferProgress, rank_address
from kpool_pd.vllm.producer_worker import ProducerWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def model_identity(vllm_config: "VllmConfig") -> str:
    """What must agree between producer and consumer for their bytes to mean the same: the model's
    config, dtype and seed (dummy weights come from it) and vLLM's version."""
    import vllm

    model = vllm_config.model_config
    config_json = model.hf_config.to_json_string(use_diff=False)
    return json.dumps({"hf_config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
                       "dtype": str(model.dtype).removeprefix("torch."), "seed": model.seed,
                       "load_format": str(vllm_config.load_config.load_format), "vllm": vllm.__version__},
                      sort_keys=True)


ROLES = {"kv_producer": (True, False), "kv_consumer": (False, True), "kv_both": (True, True)}  # produces, consumes
LAYOUT = KvLayout.PER_LAYER.vllm_name  # vLLM's KV cache layout in which a block's head slots are runs of their own


@dataclass(frozen=True)
class KpoolPdRankInfo(KVConnectorHandshakeMetadata):
    """What a producer's worker rank tells its scheduler side: the address consumers dial for it."""

    address: str


def engine_ranks(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> EngineRanks:
    """The engine's TP size, its model's KV heads and how its moved caches lie across ranks. ValueError
    for pipeline parallelism."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ValueError(f"KpoolPdConnector moves the KV of engines without pipeline parallelism; this one has "
                         f"pipeline_parallel_size {parallel.pipeline_parallel_size}")
    return EngineRanks(tp_size=parallel.tensor_parallel_size,
                       total_heads=max(1, vllm_config.model_config.get_total_num_kv_heads()),
                       sharding=sharding_of(kv_cache_config, transfer_rules(kv_cache_config)))


class KpoolPdConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_role not in ROLES:
            raise ValueError(f"KpoolPdConnector serves kv_role {sorted(ROLES)}, got {transfer.kv_role!r}")
        self.produces, self.consumes = ROLES[transfer.kv_role]
        self.settings = KpoolPdSettings.from_extra_config(transfer.kv_connector_extra_config, producer=self.produces,
                                                          consumer=self.consumes)
        self.engine_id = connector_engine_id(transfer.engine_id)
        self.identity = model_identity(vllm_config)
        self.producer_scheduler: ProducerScheduler | None = None
        self.consumer_scheduler: ConsumerScheduler | None = None
        self.producer_worker: ProducerWorker | None = None
        self.consumer_worker: ConsumerWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            rules = transfer_rules(kv_cache_config)
            self.ranks = engine_ranks(vllm_config, kv_cache_config)
            if self.produces:
                self.producer_scheduler = ProducerScheduler(self.settings, rules, engine_id=self.engine_id)
                dp = vllm_config.parallel_config.data_parallel_index
                self.producer_scheduler.rank_addresses = tuple(  # until the workers report theirs
                    rank_address(self.settings.advertise, RankSeat(tp_rank=r, tp_size=self.ranks.tp_size, dp_index=dp))
                    for r in range(self.ranks.tp_size))
            if self.consumes:
                self.consumer_scheduler = ConsumerScheduler(self.settings, rules, self.ranks)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        """The settings' ``kv_layout``: by default ``LBHNC`` for a model whose caches TP splits by head (a
        consumer rank reads just its heads), as NixlConnector asks, and none for MLA (its cache is whole on
        every rank); with ``"cross_layer"``, ``BLHNC`` for any model: a block's bytes for every layer lie
        together, so a pull sends one region per run of blocks (engines of equal TP). ValueError naming the
        choices for another value."""
        transfer = vllm_config.kv_transfer_config
        layout = KvLayout.parse(transfer.kv_connector_extra_config if transfer is not None else None)
        if layout is KvLayout.CROSS_LAYER:
            return layout.vllm_name
        model = vllm_config.model_config
        return None if model is None or model.use_mla else LAYOUT

    @property
    def _workers(self) -> list[ProducerWorker | ConsumerWorker]:
        return [w for w in (self.producer_worker, self.consumer_worker) if w is not None]

    # worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's worker, once, after it allocated the caches: every group that moves becomes planes of one
        pool. ValueError naming the group for a model whose groups cannot be moved (nothing started)."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        config = self._kv_cache_config
        layout = self._vllm_config.cache_config.get_resolved_kv_cache_layout()  # the one vLLM allocated with
        rules = transfer_rules(config)
        ranks = engine_ranks(self._vllm_config, config)
        seat = RankSeat(tp_rank=get_tensor_model_parallel_rank(), tp_size=ranks.tp_size,
                        dp_index=self._vllm_config.parallel_config.data_parallel_index)
        units = head_units(config, layout, rules) if ranks.sharding is Sharding.BY_HEAD else 0
        if units and units != ranks.units(seat.tp_rank):
            units = 0  # a head count the model's does not explain: whole blocks (equal TP only)
        if not units and ranks.sharding is Sharding.BY_HEAD:
            logger.info("KpoolPdConnector moves whole blocks of the %s KV cache layout: caches split by head move "
                        "between engines of equal TP only (%s moves each head slot)", layout.name, LAYOUT)
        pool = engine_pool(kv_caches, config, layout, rules, engine={"connector": "KpoolPdConnector"}, units=units)
        progress = TransferProgress()  # what the worker's idle steps wait on, both sides' transfers
        if self.produces:
            self.producer_worker = ProducerWorker(self.settings, pool, engine_id=self.engine_id,
                                                  model_identity=self.identity, seat=seat, units=units,
                                                  progress=progress)
            self.producer_worker.start()
        if self.consumes:
            policy = self._vllm_config.kv_transfer_config.kv_load_failure_policy
            self.consumer_worker = ConsumerWorker(self.settings, pool, engine_id=self.engine_id,
                                                  model_identity=self.identity, failure_policy=policy, ranks=ranks,
                                                  seat=seat, units=units, progress=progress)
            self.consumer_worker.start()

    def get_handshake_metadata(self) -> KpoolPdRankInfo | None:
        """vLLM's worker, once its caches are registered: a producer rank's address, for the scheduler side."""
        return None if self.producer_worker is None else KpoolPdRankInfo(self.producer_worker.address)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """vLLM's worker, every step, before the step's forward: the producer withdraws the grants of requests vLLM
        freed unanswered before that forward can write into their blocks (vLLM starts a step's loads, and so
        ``start_load_kv``, after its forward unless the step has synchronous loads), and announces at an idle
        step what it held for one (``ProducerWorker.before_forward``)."""
        super().bind_connector_metadata(connector_metadata)
        if self.producer_worker is not None:
            self.producer_worker.before_forward(connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self.consumer_worker is not None:  # where vLLM orders it: after any zeroing of the step's new blocks
            self.consumer_worker.load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs once its whole prompt landed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # nothing is saved: the producer serves its blocks where they are

    def wait_for_save(self) -> None:
        if self.producer_worker is not None:
            self.producer_worker.offer(self._get_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's worker, every step: the grants that ended (producer) and the pulls that ended and those of
        them that failed (consumer). A failed pull is reported by request (``failed_recving``), never by block
        ids, which vLLM cannot map back to requests with several KV cache groups."""
        results = KVConnectorTransferResults()
        if not self._workers:
            return results
        self._workers[0].progress.wait_if_idle(self._get_connector_metadata())
        if self.producer_worker is not None:
            results.finished_sending = self.producer_worker.finished_sending(finished_req_ids)
        if self.consumer_worker is not None:
            results.finished_recving, results.failed_recving = self.consumer_worker.finished_recving()
        return results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_kv_connector_stats(self) -> KpoolPdStats | None:
        """vLLM's worker, every step: the counts since the last call (``kpool_pd.vllm.stats``)."""
        taken = [stats for worker in self._workers if (stats := worker.take_stats()) is not None]
        return taken[0].aggregate(taken[1]) if len(taken) == 2 else (taken[0] if taken else None)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KpoolPdStats:
        return KpoolPdStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KpoolPdPromMetrics:
        return KpoolPdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        workers, self.producer_worker, self.consumer_worker = self._workers, None, None
        for worker in workers:
            worker.close()

    # scheduler side ---------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """vLLM's engine core, once: every producer rank's address (by TP rank), for the params it hands out.
        ValueError naming the ranks when one is missing."""
        if self.producer_scheduler is None or not metadata:
            return
        ranks = self.ranks.tp_size
        if sorted(metadata) != list(range(ranks)) or not all(isinstance(m, KpoolPdRankInfo) for m in metadata.values()):
            raise ValueError(f"KpoolPdConnector: TP ranks {sorted(metadata)} reported their addresses, "
                             f"expected 0..{ranks - 1}")
        self.producer_scheduler.rank_addresses = tuple(metadata[r].address for r in range(ranks))
        logger.info("KpoolPdConnector producer %s: ranks serve on %s", self.engine_id,
                    ", ".join(self.producer_scheduler.rank_addresses))

    def update_connector_output(self, connector_output) -> None:
        if self.consumer_scheduler is not None:
            self.consumer_scheduler.update_connector_output(connector_output)

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.producer_scheduler is not None:
            self.producer_scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.consumer_scheduler is not None:
            return self.consumer_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        return 0, False

    def on_new_request(self, request: "Request") -> None:
        if self.consumer_scheduler is not None:
            self.consumer_scheduler.on_new_request(request)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        for scheduler in (self.producer_scheduler, self.consumer_scheduler):
            if scheduler is not None:
                scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """One step's metadata: the producer's offers and the consumer's loads, releases and renewals."""
        metas = [scheduler.build_connector_meta(scheduler_output)
                 for scheduler in (self.producer_scheduler, self.consumer_scheduler) if scheduler is not None]
        if len(metas) == 1:
            return metas[0]
        offered, consumed = metas
        return dataclasses.replace(consumed, offers=offered.offers, withdrawals=offered.withdrawals)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's scheduler, once per request, before it frees the request's blocks of every group (vLLM
        calls this instead of ``request_finished`` for a connector that ``SupportsHMA``). A ``kv_both``
        instance asks its producer side first (a request it offered keeps its blocks for the grant), then
        its consumer side (a request that never loaded releases the grant it named)."""
        delay, params = False, None
        if self.producer_scheduler is not None:
            delay, params = self.producer_scheduler.request_finished(request, block_ids)
        if self.consumer_scheduler is not None and not delay:
            self.consumer_scheduler.request_finished(request, block_ids)
        return delay, params
