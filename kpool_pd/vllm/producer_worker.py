"""The producer's worker side (``kv_producer``): serves PrefillService from vLLM's blocks.

vLLM owns the blocks: an offered grant holds vLLM's block ids as a lent allocation
(``kvcache.EngineCache.lend``) whose release tells vLLM it may free them (``get_finished``: finished
sending). A request's blocks come per KV cache group; the connector names each by one id
(``kpool_pd.vllm.metadata.flat_ids``).

With ``release_after_pull`` (the default) a grant ends as soon as a pull has sent it all (the connector's
``on_pull_done``): its blocks go back to vLLM at once, and the consumer, told so by the params, sends no
Release (a Release round trip a request, and a gRPC call on both sides while the consumer computes). A
pull that failed before its last byte keeps the grant, for the consumer's Release or the lease.

**Ranks.** Each TP rank's worker serves on its own port (``RankSeat.port``) and holds each request as its
whole grant and, in a pool of head units with several slots a block, one grant per slot (``slot_key``); the
request's blocks go back to vLLM once all of them ended, and the whole grant's end releases the slot grants
no consumer rank claimed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import torch

from prometheus_client import CollectorRegistry

from kpool_pd.connector import Announcement, EngineUnavailable, PrefillConnector, PrefillInput, PrefillProgress, StatusError
from kpool_pd.connector import prefill_api as pb
from kpool_pd.kvcache import EngineCache, PlanarPool
from kpool_pd.runtime import GrpcServer
from kpool_pd.vllm.loop import ConnectorLoop, TransferProgress, connector_config, rank_address, warm_staging
from kpool_pd.vllm.metadata import KpoolPdMetadata, producer_params
from kpool_pd.vllm.ranks import RankSeat, slot_key
from kpool_pd.vllm.settings import AnnounceWhen, KpoolPdSettings
from kpool_pd.vllm.stats import StatsRecorder
from kpool_pd.vllm.units import unit_ids

logger = logging.getLogger(__name__)


def _logged_failure(task: asyncio.Task) -> None:
    """A background task's end: its exception logged (nobody awaits it)."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("announcing grants failed", exc_info=task.exception())


class NoPrefillCalls:
    """A vLLM producer computes the prompts its own scheduler admits; it answers no Prefill call."""

    async def prefill(self, request: PrefillInput, progress: PrefillProgress):
        raise EngineUnavailable("this prefill node is a vLLM instance: send prompts to vLLM with "
                                "kv_transfer_params {\"do_remote_decode\": true}")


class ProducerWorker:
    """Serves vLLM's blocks on ``settings.listen`` (its rank's port of it) once ``start`` ran. ``units``:
    the head slots a block holds in a pool of head units (0: whole blocks); ``progress``: what vLLM's idle
    steps wait on (a ``kv_both`` engine's two sides share one)."""

    def __init__(self, settings: KpoolPdSettings, pool: PlanarPool, *, engine_id: str, model_identity: str,
                 seat: RankSeat = RankSeat(), units: int = 0, progress: TransferProgress | None = None) -> None:
        self.settings, self.seat, self.units = settings, seat, units
        self.engine_id = seat.engine_id(engine_id)
        self.listen = (settings.listen[0], seat.port(settings.listen[1]))
        self.address = rank_address(settings.advertise, seat)  # what the scheduler hands consumers for this rank
        self.cache = EngineCache(pool)
        self._lock = threading.Lock()
        self._holding: dict[str, int] = {}  # request -> its grants on this rank not ended yet (the loop's)
        self._ended: set[str] = set()  # requests whose grants all ended (their blocks are vLLM's to free again)
        self._finished: set[str] = set()  # requests vLLM said finished
        self._withdrawn: set[str] = set()  # requests vLLM freed unanswered: never reported, whatever ends later
        self._keys: dict[str, tuple[str, ...]] = {}  # request -> its grants' keys on this rank, while it holds any
        self.progress = progress or TransferProgress()
        self.stats = StatsRecorder()
        self.loop = ConnectorLoop("kpoolpd-producer")
        self._registry = CollectorRegistry()
        self._expired_seen = 0.0
        self.node = PrefillConnector(pool, NoPrefillCalls(), engine_id=self.engine_id,
                                     config=connector_config(settings), registry=self._registry,
                                     model_identity=model_identity)
        self.server: GrpcServer | None = None
        self.announce = settings.announce
        self._announcing = False  # announcements held since the last idle step (AnnounceWhen.IDLE; engine thread)
        self._held_announcements: list[tuple[list, object]] = []  # (offers, their step's CUDA event): the loop's,
        # waiting for an idle step (``AnnounceWhen.IDLE``)
        if settings.release_after_pull:
            self.node.on_pull_done = self._pull_sent

    def _pull_sent(self, outbound) -> None:
        """A pull sent its grant's every byte (on the loop, as its stream ends): the grant is released, and
        freed as soon as no pull reads it (the pull's own end reaps it)."""
        outbound.grant.release_requested = True

    def start(self) -> None:
        warm_staging(self.node.packed_pulls.staging, self.cache.pool)
        async def start():
            await self.node.start()
            config = self.node.config
            self.server = GrpcServer(peer_token=config.peer_token, tls=config.tls, options=config.grpc_options())
            self.server.add(self.node)
            host, port = self.listen
            await self.server.start(host, port)
            await self.server.health.open(self.server)
        self.loop.call(start)
        logger.info("kpool-pd producer %s (TP rank %d of %d, DP rank %d) serves vLLM's blocks on %s:%d, advertised "
                    "as %s", self.engine_id, self.seat.tp_rank, self.seat.tp_size, self.seat.dp_index, *self.listen,
                    self.address)

    def offer(self, metadata: KpoolPdMetadata) -> None:
        """Hold this step's computed prompts as grants, without waiting for the loop. Each request counts as held
        from here (``finished_sending`` keeps its blocks until its grants end), and its grants are lent by one
        callback queued on the loop now: ahead of anything that reaches the loop later, so of every pull of them
        (which can only come once this step's output left the engine) and of the next step's withdrawals. A
        blocking call cost each step with offers a round trip to the loop thread: 0.7 ms (median of 52) on the
        2-core CPU machine, 2026-12-07."""
        if not metadata.offers:
            return
        planned = [(offer, self._hold(offer)) for offer in metadata.offers]
        computed = None  # where the pool is on a GPU, the step's kernels end before a prefetch may read them
        named = any(offer.prefetch_by for offer in metadata.offers)
        if self.cache.pool.device.type == "cuda" and named:
            computed = torch.cuda.Event()
            computed.record()
        self._announcing = self._announcing or (named and self.announce is AnnounceWhen.IDLE)
        self.loop.post(self._lend_all, planned, computed)

    def before_forward(self, metadata: KpoolPdMetadata) -> None:
        """A step's metadata, before its forward (``KpoolPdConnector.bind_connector_metadata``): end the grants of
        offered requests vLLM freed with no answer to their client (their blocks are vLLM's again and may be
        written in this very step); and, at a step that computes nothing, announce the grants held for it
        (``AnnounceWhen.IDLE``), queued on the loop after the offers' lending, so after every grant offered so
        far."""
        if metadata.withdrawals:
            self.loop.call(lambda: self._withdraw_all(metadata.withdrawals))
        if metadata.idle and self._announcing:
            self._announcing = False
            self.loop.post(self._announce_held)

    async def _withdraw_all(self, request_ids) -> None:
        for rid in request_ids:
            with self._lock:
                self._withdrawn.add(rid)
                keys = self._keys.get(rid, ())
            for key in keys:
                try:
                    self.node.grants.release(pb.ReleaseRequest(grant_id=key))
                except StatusError:
                    pass  # ended already, or a consumer holds it (it cannot: nobody got the params)
            self.stats.count("grants_withdrawn")
            logger.info("request %s ended unanswered; its grants on this rank are withdrawn", rid)
            self._forget_withdrawn(rid)

    def _forget_withdrawn(self, rid: str) -> None:
        """Drop a withdrawn request from the books once none of its grants is held any more."""
        with self._lock:
            if rid in self._withdrawn and rid not in self._holding:
                self._withdrawn.discard(rid)
                self._ended.discard(rid)
                self._finished.discard(rid)
                self._keys.pop(rid, None)

    def _grants_of(self, offer) -> list[tuple[str, tuple[int, ...]]]:
        """(key, the connector's ids) of each grant this rank holds ``offer`` as: the whole grant (every
        slot of every block) first, then one grant per head slot when a block holds several."""
        units = max(self.units, 1)
        grants = [(offer.key, unit_ids(self.cache.layout, offer.block_ids, units=units, slots=range(units)))]
        if units > 1:
            grants += [(slot_key(offer.key, slot), unit_ids(self.cache.layout, offer.block_ids, units=units,
                                                            slots=(slot,))) for slot in range(units)]
        return grants

    def _hold(self, offer) -> list[tuple[str, tuple[int, ...]]]:
        """Count ``offer``'s request as held by the grants it will be lent as (engine thread); none, counted as
        one that ends at once, where its blocks are not this engine's."""
        rid = offer.request_id
        try:
            grants = self._grants_of(offer)
        except ValueError:
            logger.exception("request %s could not be offered: its blocks are not this engine's", rid)
            grants = []
        with self._lock:
            self._holding[rid] = len(grants) or 1
            self._keys[rid] = tuple(key for key, _ in grants)
        return grants

    def _lend_all(self, planned: list[tuple[object, list[tuple[str, tuple[int, ...]]]]], computed=None) -> None:
        """Lend each held request's grants (on the loop). The whole grant's end releases this request's own
        unclaimed slot grants: the keys are bound here, per offer, so that offers of one step (several requests'
        prompts computed together) never hand each other's keys to their releases. A grant that cannot be lent
        counts as ended, so that its request's blocks still go back to vLLM. The whole grants of requests that
        named their consumer (``prefetch_by``) are then announced to it, once ``computed`` (the step's CUDA
        event, None in host memory) completed: at once, or at the next idle step (``AnnounceWhen.IDLE``)."""
        announced = []
        for offer, grants in planned:
            rid = offer.request_id
            self.stats.count("grants_offered")
            if not grants:
                self._grant_ended(rid)
                continue
            slot_keys = tuple(key for key, _ in grants[1:])
            for index, (key, ids) in enumerate(grants):
                lent = self._lend(offer, key, ids, slot_keys if index == 0 else ())
                if index == 0 and lent and offer.prefetch_by:
                    announced.append(offer)
        if not announced:
            return
        if self.announce is AnnounceWhen.IDLE:
            self._held_announcements.append((announced, computed))
            return
        asyncio.ensure_future(self._announce(announced, computed)).add_done_callback(_logged_failure)

    def _announce_held(self) -> None:
        """An idle step (on the loop): announce the held grants whose requests still hold them (one pulled or
        withdrawn meanwhile is not announced: its consumer would find it gone)."""
        held, self._held_announcements = self._held_announcements, []
        for offers, computed in held:
            with self._lock:
                live = [offer for offer in offers if offer.request_id in self._keys]
            if live:
                asyncio.ensure_future(self._announce(live, computed)).add_done_callback(_logged_failure)

    async def _announce(self, offers: list, computed) -> None:
        """Announce each offer's whole grant to the consumer it names (``OfferBoard``), with the params its
        decode request will carry. Only where one rank holds each request (one TP rank: a consumer engine's ranks
        otherwise pull shares of several)."""
        if self.seat.tp_size != 1:
            return
        if computed is not None:
            await asyncio.get_running_loop().run_in_executor(None, computed.synchronize)
        for offer in offers:
            params = producer_params(offer, address=self.address, engine_id=self.engine_id,
                                     lease_s=self.settings.lease_s, rank_addresses=(self.address,),
                                     released_after_pull=self.settings.release_after_pull)
            if self.node.offer_board.post(offer.prefetch_by, Announcement(offer.key, json.dumps(params))):
                self.stats.count("grants_announced")

    def _lend(self, offer, key: str, ids: tuple[int, ...], slot_keys: tuple[str, ...]) -> bool:
        """Offer one grant of ``offer`` (``key`` over the connector's ``ids``); its end counts down the
        request's grants and releases ``slot_keys`` (the whole grant's own slot grants; none for a slot
        grant). A grant that cannot be held counts as ended at once; returns whether it was offered."""
        rid = offer.request_id
        try:
            allocation = self.cache.lend(rid, ids, on_release=lambda: self._grant_ended(rid, slot_keys))
        except Exception:  # on the loop, where nobody waits for an error: it must end the grant, not escape
            logger.exception("request %s could not be offered: its blocks are not this engine's", rid)
            self._grant_ended(rid)
            return False
        try:
            self.node.offer(allocation, grant_id=key, request_id=rid, prompt_len=offer.prompt_len)
        except Exception:
            logger.exception("request %s could not be offered; its blocks go back to vLLM", rid)
            allocation.release()
            return False
        return True

    def _grant_ended(self, request_id: str, slot_keys=()) -> None:
        """One of the request's grants ended (on the loop): once all did, its blocks are vLLM's again. The
        whole grant's end releases the slot grants no consumer rank claimed (none will pull them now)."""
        with self._lock:  # a request is in _holding or in _ended until vLLM frees it (finished_sending reads both)
            left = self._holding.get(request_id, 1) - 1
            if left > 0:
                self._holding[request_id] = left
            else:
                self._holding.pop(request_id, None)
                self._keys.pop(request_id, None)
                self._ended.add(request_id)
        if left <= 0:
            self._forget_withdrawn(request_id)
            self.progress.note()
        if slot_keys:
            self.loop.loop.call_soon(self._release_unclaimed, tuple(slot_keys))

    def _release_unclaimed(self, keys: tuple[str, ...]) -> None:
        for key in keys:
            try:
                self.node.grants.release(pb.ReleaseRequest(grant_id=key))
            except StatusError:
                pass  # a consumer rank claimed it: it pulls or releases it

    def take_stats(self):
        """The counts since the last call (``KpoolPdStats``, or None), the leases that expired among them."""
        expired = self._registry.get_sample_value("kpoolpd_prefill_leases_expired_total") or 0.0
        if expired > self._expired_seen:
            self.stats.count("leases_expired", int(expired - self._expired_seen))
            self._expired_seen = expired
        return self.stats.take()

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished whose grant ended: their blocks may be freed. Only offered requests are kept
        waiting (a request offered is in ``_holding`` or ``_ended`` from its offer, before vLLM can finish it,
        until it is reported here); the others vLLM finished are not this rank's to wait for."""
        with self._lock:
            self._finished |= {rid for rid in finished_req_ids
                               if (rid in self._holding or rid in self._ended) and rid not in self._withdrawn}
            done = self._ended & self._finished
            self._ended -= done
            self._finished -= done
        return done

    def close(self) -> None:
        async def stop():
            if self.server is not None:
                await self.server.stop(0)
            await self.node.stop()
        try:
            self.loop.call(stop)
        finally:
            self.loop.close()
