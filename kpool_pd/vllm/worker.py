"""The worker side of the connector (the process that holds vLLM's KV tensors): a producer serves
PrefillService from vLLM's blocks, a consumer pulls into them.

The project's connector runs on an event loop in a thread of its own (``ConnectorLoop``); vLLM's worker
calls in from its thread and hands work over. vLLM owns the blocks: an offered grant holds vLLM's block
ids as a lent allocation (``kvcache.EngineCache.lend``) whose release tells vLLM it may free them
(``get_finished``: finished sending); a pull lands into a lent allocation of the blocks vLLM allocated
for the decode request, and its end is reported as finished receiving (and, if it failed, as failed
receiving: vLLM then recomputes the prompt or fails the request, as its ``kv_load_failure_policy`` says,
for models of one KV cache group or several). A request's blocks come per KV cache group; the connector
names each by one id (``kpool_pd.vllm.metadata.flat_ids``).

A consumer dials only the producers its settings allow (``KpoolPdSettings.producers``); a grant it will
not pull (a failed load, a Release from the scheduler side) is released on the producer at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable

import grpc

from prometheus_client import CollectorRegistry

from kpool_pd.connector import (
    ConnectorConfig,
    DecodeConnector,
    EngineUnavailable,
    PrefillConnector,
    PrefillInput,
    PrefillPeer,
    PrefillProgress,
    StatusError,
)
from kpool_pd.vllm.metadata import KpoolPdMetadata, Load, Release, Renew, flat_ids, grant_from
from kpool_pd.vllm.settings import KpoolPdSettings
from kpool_pd.vllm.stats import StatsRecorder
from kpool_pd.kvcache import EngineCache, PlanarPool
from kpool_pd.runtime import GrpcServer

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0  # a hand-over to the loop (start, an offer) that takes longer is a failure
RENEW_TICK_S = 0.25  # how often the consumer looks for queued requests' grants due for renewal
IDLE_WAIT_S = 0.02  # the longest an idle step waits for the connector's thread (a new request waits as long)


def _now() -> float:
    return time.monotonic()


class TransferProgress:
    """The connector's thread tells vLLM's idle steps that a transfer ended."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def note(self) -> None:
        self._event.set()

    def wait_if_idle(self, metadata: KpoolPdMetadata) -> None:
        if metadata.idle:
            self._event.wait(IDLE_WAIT_S)
        self._event.clear()


class ConnectorLoop:
    """An asyncio loop in a daemon thread; ``call`` runs a coroutine there and waits for its result."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, make: Callable[[], Awaitable], timeout_s: float = CALL_TIMEOUT_S):
        async def run():
            return await make()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout_s)

    def submit(self, make: Callable[[], Awaitable]) -> None:
        async def run():
            await make()
        asyncio.run_coroutine_threadsafe(run(), self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CALL_TIMEOUT_S)


class NoPrefillCalls:
    """A vLLM producer computes the prompts its own scheduler admits; it answers no Prefill call."""

    async def prefill(self, request: PrefillInput, progress: PrefillProgress):
        raise EngineUnavailable("this prefill node is a vLLM instance: send prompts to vLLM with "
                                "kv_transfer_params {\"do_remote_decode\": true}")


def connector_config(settings: KpoolPdSettings) -> ConnectorConfig:
    return ConnectorConfig(peer_token=settings.peer_token, lease_s=settings.lease_s,
                           transfer_timeout_s=settings.pull_timeout_s, rpc_timeout_s=settings.rpc_timeout_s)


class ProducerWorker:
    """Serves vLLM's blocks on ``settings.listen`` once ``start`` ran."""

    def __init__(self, settings: KpoolPdSettings, pool: PlanarPool, *, engine_id: str, model_identity: str) -> None:
        self.settings, self.engine_id = settings, engine_id
        self.cache = EngineCache(pool)
        self._lock = threading.Lock()
        self._ended: set[str] = set()  # grants ended (their blocks are vLLM's to free again)
        self._finished: set[str] = set()  # requests vLLM said finished
        self.progress = TransferProgress()
        self.stats = StatsRecorder()
        self.loop = ConnectorLoop("kpoolpd-producer")
        self._registry = CollectorRegistry()
        self._expired_seen = 0.0
        self.node = PrefillConnector(pool, NoPrefillCalls(), engine_id=engine_id,
                                     config=connector_config(settings), registry=self._registry,
                                     model_identity=model_identity)
        self.server: GrpcServer | None = None

    def start(self) -> None:
        async def start():
            await self.node.start()
            config = self.node.config
            self.server = GrpcServer(peer_token=config.peer_token, tls=config.tls, options=config.grpc_options())
            self.server.add(self.node)
            host, port = self.settings.listen
            await self.server.start(host, port)
            await self.server.health.open(self.server)
        self.loop.call(start)
        logger.info("kpool-pd producer %s serves vLLM's blocks on %s:%d", self.engine_id, *self.settings.listen)

    def offer(self, metadata: KpoolPdMetadata) -> None:
        """Hold this step's computed prompts as grants (before the step's output leaves the engine)."""
        if metadata.offers:
            self.loop.call(lambda: self._offer_all(metadata))

    async def _offer_all(self, metadata: KpoolPdMetadata) -> None:
        for offer in metadata.offers:
            try:
                ids = flat_ids(self.cache.layout, offer.block_ids)
                allocation = self.cache.lend(offer.request_id, ids,
                                             on_release=lambda rid=offer.request_id: self._grant_ended(rid))
            except ValueError:
                logger.exception("request %s could not be offered: its blocks are not this engine's", offer.request_id)
                self._grant_ended(offer.request_id)
                continue
            try:
                self.node.offer(allocation, grant_id=offer.key, request_id=offer.request_id,
                                prompt_len=offer.prompt_len)
            except ValueError:
                logger.exception("request %s could not be offered; its blocks go back to vLLM", offer.request_id)
                allocation.release()
                continue
            self.stats.count("grants_offered")

    def _grant_ended(self, request_id: str) -> None:
        with self._lock:
            self._ended.add(request_id)
        self.progress.note()

    def take_stats(self):
        """The counts since the last call (``KpoolPdStats``, or None), the leases that expired among them."""
        expired = self._registry.get_sample_value("kpoolpd_prefill_leases_expired_total") or 0.0
        if expired > self._expired_seen:
            self.stats.count("leases_expired", int(expired - self._expired_seen))
            self._expired_seen = expired
        return self.stats.take()

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished whose grant ended: their blocks may be freed."""
        with self._lock:
            self._finished |= finished_req_ids
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


class ProducerRefused(ValueError):
    """A request named a producer this consumer's settings do not allow."""


FAILURE_OUTCOMES = {"recompute": "vLLM recomputes the prompt (kv_load_failure_policy 'recompute')",
                    "fail": "vLLM fails the request (kv_load_failure_policy 'fail')"}


class ConsumerWorker:
    """Pulls producers' grants into vLLM's blocks; releases the grants it will not pull. ``failure_policy``:
    vLLM's ``kv_load_failure_policy``, for the log line of a failed pull (vLLM acts on it)."""

    def __init__(self, settings: KpoolPdSettings, pool: PlanarPool, *, engine_id: str, model_identity: str,
                 failure_policy: str = "fail") -> None:
        if failure_policy not in FAILURE_OUTCOMES:
            raise ValueError(f"kv_load_failure_policy must be one of {sorted(FAILURE_OUTCOMES)}, got {failure_policy!r}")
        self.settings, self.engine_id = settings, engine_id
        self.failure_outcome = FAILURE_OUTCOMES[failure_policy]
        self.cache = EngineCache(pool)
        self._lock = threading.Lock()
        self._received: set[str] = set()
        self._failed: set[str] = set()
        self.progress = TransferProgress()
        self.stats = StatsRecorder()
        self.loop = ConnectorLoop("kpoolpd-consumer")
        self.node = DecodeConnector(pool, engine_id=engine_id, config=connector_config(settings),
                                    registry=CollectorRegistry(), transports=(settings.transport,),
                                    model_identity=model_identity)
        self._peers: dict[str, PrefillPeer] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._renewing: dict[str, tuple[Renew, float]] = {}  # request id -> its renewal, when it is next due

    def start(self) -> None:
        self.loop.call(self.node.start)
        self.loop.submit(self._renew_forever)

    def load(self, metadata: KpoolPdMetadata) -> None:
        """Start this step's pulls and releases (they run on the loop; ``finished_recving`` reports pulls),
        and keep the grants of the requests that joined vLLM's queue alive until their load or release."""
        with self._lock:
            now = _now()
            for renew in metadata.renewals:
                self._renewing[renew.request_id] = (renew, now + renew.lease_s / 3)
            for ended in (*metadata.loads, *metadata.releases):
                self._renewing.pop(ended.request_id, None)
        for load in metadata.loads:
            self.loop.submit(lambda load=load: self._pull(load))
        for release in metadata.releases:
            self.loop.submit(lambda release=release: self._release(release))

    async def _peer(self, address: str) -> PrefillPeer:
        """The handshaken peer at ``address``; ProducerRefused for an address the settings do not allow (it
        is never dialed). A peer that fails its handshake is not kept (``DecodeConnector.connect`` closed it)."""
        if not self.settings.producers.allows(address):
            raise ProducerRefused(f"producer {address!r} is not among this consumer's producers "
                                  "(kv_connector_extra_config['producers'])")
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            peer = self._peers.get(address)
            if peer is None or peer.closed:
                peer = self._peers[address] = await self._connect(address)
            return peer

    async def _connect(self, address: str) -> PrefillPeer:
        """A handshake with ``address``, retried once when it timed out or could not reach the producer (a
        loaded producer answering late: the retry presents the same engine secret, so the producer admits
        it as the engine its first answer was for)."""
        try:
            return await self.node.connect(address)
        except StatusError as exc:
            if exc.code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                raise
            logger.warning("handshake with producer %s failed (%s); trying once more", address, exc)
        return await self.node.connect(address)

    async def _pull(self, load: Load) -> None:
        peer, grant, failed = None, None, True
        try:
            if load.error:
                raise ValueError(load.error)
            grant, landed = grant_from(load.params, load.digest, self.cache.layout, load.block_ids)
            peer = await self._peer(load.params.address)
            with self.cache.lend(load.request_id, landed, on_release=lambda: None) as allocation:
                pulled = await peer.pull(grant, into=allocation, transport=self.settings.transport,
                                         integrity=self.settings.integrity)
            failed = False
            self.stats.pulled(pulled.nbytes, pulled.regions, pulled.seconds)
        except Exception as exc:  # every failure: vLLM recomputes or fails the request (reported below)
            logger.warning("KV transfer of request %s failed, %s: %s", load.request_id, self.failure_outcome, exc)
        finally:
            with self._lock:
                self._received.add(load.request_id)
                if failed:
                    self._failed.add(load.request_id)
            if failed:
                self.stats.count("pull_failures")
            self.progress.note()
        if failed:  # the grant is ours to give back (a failed pull does not release it)
            await self._release(Release(request_id=load.request_id, address=load.params.address,
                                        key=load.params.key if grant is None else grant.grant_id,
                                        why="its load failed"), peer)

    async def _release(self, release: Release, peer: PrefillPeer | None = None) -> None:
        """Release a grant on its producer, best effort: a failure is logged, and the lease frees it."""
        try:
            peer = peer if peer is not None and not peer.closed else await self._peer(release.address)
            released = await peer.release(release.key)
        except Exception as exc:
            logger.warning("grant of request %s on %s not released (%s); its lease frees it: %s", release.request_id,
                           release.address, release.why, exc)
            return
        if released:
            self.stats.count("grants_released")
        logger.info("grant of request %s on %s %s: %s", release.request_id, release.address,
                    "released" if released else "was already gone", release.why)

    async def _renew_forever(self) -> None:
        """Every RENEW_TICK_S: renew the grants of queued requests due (a third of their lease since the
        last renewal). A grant the producer no longer holds, or holds for another engine, is dropped (its
        load will fail and be reported); one that could not be reached is tried again at the next tick."""
        while True:
            await asyncio.sleep(RENEW_TICK_S)
            with self._lock:
                now = _now()
                due = [renew for renew, at in self._renewing.values() if at <= now]
                for renew in due:
                    self._renewing[renew.request_id] = (renew, now + renew.lease_s / 3)
            if due:
                await asyncio.gather(*(self._renew(renew) for renew in due))

    async def _renew(self, renew: Renew) -> None:
        try:
            peer = await self._peer(renew.address)
            gone = await peer.heartbeat([renew.key])
        except (StatusError, ProducerRefused) as exc:
            if isinstance(exc, StatusError) and exc.code not in (grpc.StatusCode.PERMISSION_DENIED,
                                                                  grpc.StatusCode.INVALID_ARGUMENT):
                logger.debug("renewing the grant of request %s on %s: %s", renew.request_id, renew.address, exc)
                return
            gone = [renew.key]
            logger.warning("the grant of queued request %s on %s is not renewed: %s", renew.request_id,
                           renew.address, exc)
        if gone:
            with self._lock:
                self._renewing.pop(renew.request_id, None)
        else:
            self.stats.count("grants_renewed")

    def renewing(self) -> set[str]:
        """The queued requests whose grants are being kept alive."""
        with self._lock:
            return set(self._renewing)

    def take_stats(self):
        """The counts since the last call (``KpoolPdStats``, or None)."""
        return self.stats.take()

    def finished_recving(self) -> tuple[set[str], set[str]]:
        """(finished, failed) since the last call: every ended pull, and those that failed among them."""
        with self._lock:
            done, failed = self._received, self._failed
            self._received, self._failed = set(), set()
        return done, failed

    def close(self) -> None:
        try:
            self.loop.call(self.node.close)
        finally:
            self.loop.close()
