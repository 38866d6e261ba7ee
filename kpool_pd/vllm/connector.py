"""``KpoolPdConnector``: kpool-pd as vLLM's KV connector (``KVConnectorBase_V1``), loaded with
``--kv-transfer-config '{"kv_connector": "KpoolPdConnector", "kv_connector_module_path": "kpool_pd.vllm",
"kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_connector_extra_config": {...}}'`` (``kpool_pd.vllm.settings``).

vLLM makes one instance per role: the scheduler side (``kpool_pd.vllm.scheduler``) in its engine core
and the worker side (``kpool_pd.vllm.worker``) beside the KV tensors; this class routes each of vLLM's
calls to the part of the role it was made for. A ``kv_both`` instance has a producer and a consumer part
on each side: it offers the requests that say ``do_remote_decode`` and pulls those that say
``do_remote_prefill``, as NixlConnector allows. It moves every KV cache group vLLM transfers, and keeps
vLLM's hybrid KV cache manager on (``SupportsHMA``): full-attention and MLA groups (``tokens_per_state``
pages too: GLM-5-Next's indexer, QSA's compressed keys) by the prompt's blocks, sliding-window groups by
the blocks in the window, per-request rings (``CircularBufferSpec``: GLM-5-Next's tail, QSA's key-state
ring, drafts' slots included) whole (``kpool_pd.vllm.groups``). A model with a group it cannot move
(e.g. Mamba state, chunked-local attention, a host-resident group) is refused with a ValueError naming
the group and why, when the scheduler side is made and when the worker side registers the caches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kpool_pd.vllm.groups import transfer_rules
from kpool_pd.vllm.planes import engine_pool
from kpool_pd.vllm.scheduler import ConsumerScheduler, ProducerScheduler
from kpool_pd.vllm.settings import KpoolPdSettings
from kpool_pd.vllm.stats import KpoolPdPromMetrics, KpoolPdStats
from kpool_pd.vllm.worker import ConsumerWorker, ProducerWorker

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


class KpoolPdConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_role not in ROLES:
            raise ValueError(f"KpoolPdConnector serves kv_role {sorted(ROLES)}, got {transfer.kv_role!r}")
        self.produces, self.consumes = ROLES[transfer.kv_role]
        self.settings = KpoolPdSettings.from_extra_config(transfer.kv_connector_extra_config, producer=self.produces,
                                                          consumer=self.consumes)
        self.engine_id = f"vllm-{transfer.engine_id}"
        self.identity = model_identity(vllm_config)
        self.producer_scheduler: ProducerScheduler | None = None
        self.consumer_scheduler: ConsumerScheduler | None = None
        self.producer_worker: ProducerWorker | None = None
        self.consumer_worker: ConsumerWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            rules = transfer_rules(kv_cache_config)
            if self.produces:
                self.producer_scheduler = ProducerScheduler(self.settings, rules, engine_id=self.engine_id)
            if self.consumes:
                self.consumer_scheduler = ConsumerScheduler(self.settings, rules)

    @property
    def _workers(self) -> list[ProducerWorker | ConsumerWorker]:
        return [w for w in (self.producer_worker, self.consumer_worker) if w is not None]

    # worker side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's worker, once, after it allocated the caches: every group that moves becomes planes of one
        pool. ValueError naming the group for a model whose groups cannot be moved (nothing started)."""
        config = self._kv_cache_config
        layout = self._vllm_config.cache_config.get_resolved_kv_cache_layout()  # the one vLLM allocated with
        pool = engine_pool(kv_caches, config, layout, transfer_rules(config), engine={"connector": "KpoolPdConnector"})
        if self.produces:
            self.producer_worker = ProducerWorker(self.settings, pool, engine_id=self.engine_id,
                                                  model_identity=self.identity)
            self.producer_worker.start()
        if self.consumes:
            policy = self._vllm_config.kv_transfer_config.kv_load_failure_policy
            self.consumer_worker = ConsumerWorker(self.settings, pool, engine_id=self.engine_id,
                                                  model_identity=self.identity, failure_policy=policy)
            self.consumer_worker.start()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self.consumer_worker is not None:
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
        return dataclasses.replace(consumed, offers=offered.offers)

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
