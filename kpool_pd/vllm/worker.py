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

**Ranks.** Each TP rank's worker serves and pulls on its own (``kpool_pd.vllm.ranks``): a producer rank
serves on its own port (``RankSeat.port``) and holds each request as its whole grant and, in a pool of
head units with several slots a block, one grant per slot (``slot_key``); the request's blocks go back to
vLLM once all of them ended, and the whole grant's end releases the slot grants no consumer rank claimed.
A consumer rank pulls the reads its plan gives it, each into the slots it holds, and acts only on the
Releases and Renews addressed to its rank.
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
from kpool_pd.connector import prefill_api as pb
from kpool_pd.vllm.metadata import KpoolPdMetadata, Load, Release, Renew, rank_grant, read_key
from kpool_pd.vllm.ranks import EngineRanks, RankSeat, Read, slot_key
from kpool_pd.vllm.units import unit_ids
from kpool_pd.vllm.settings import KpoolPdSettings
from kpool_pd.vllm.stats import StatsRecorder
from kpool_pd.kvcache import EngineCache, PlanarPool
from kpool_pd.runtime import GrpcServer
from kpool_pd.transfer_params import grant_key, split_host_port

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


def rank_address(address: str, seat: RankSeat) -> str:
    """``address`` (``"host:port"``, the engine's) with the port of ``seat``'s rank."""
    host, port = split_host_port(address, "the producer's address")
    return f"[{host}]:{seat.port(port)}" if ":" in host else f"{host}:{seat.port(port)}"


class ProducerWorker:
    """Serves vLLM's blocks on ``settings.listen`` (its rank's port of it) once ``start`` ran. ``units``:
    the head slots a block holds in a pool of head units (0: whole blocks)."""

    def __init__(self, settings: KpoolPdSettings, pool: PlanarPool, *, engine_id: str, model_identity: str,
                 seat: RankSeat = RankSeat(), units: int = 0) -> None:
        self.settings, self.seat, self.units = settings, seat, units
        self.engine_id = seat.engine_id(engine_id)
        self.listen = (settings.listen[0], seat.port(settings.listen[1]))
        self.address = rank_address(settings.advertise, seat)  # what the scheduler hands consumers for this rank
        self.cache = EngineCache(pool)
        self._lock = threading.Lock()
        self._holding: dict[str, int] = {}  # request -> its grants on this rank not ended yet (the loop's)
        self._ended: set[str] = set()  # requests whose grants all ended (their blocks are vLLM's to free again)
        self._finished: set[str] = set()  # requests vLLM said finished
        self.progress = TransferProgress()
        self.stats = StatsRecorder()
        self.loop = ConnectorLoop("kpoolpd-producer")
        self._registry = CollectorRegistry()
        self._expired_seen = 0.0
        self.node = PrefillConnector(pool, NoPrefillCalls(), engine_id=self.engine_id,
                                     config=connector_config(settings), registry=self._registry,
                                     model_identity=model_identity)
        self.server: GrpcServer | None = None

    def start(self) -> None:
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
        """Hold this step's computed prompts as grants (before the step's output leaves the engine)."""
        if metadata.offers:
            self.loop.call(lambda: self._offer_all(metadata))

    def _grants_of(self, offer) -> list[tuple[str, tuple[int, ...]]]:
        """(key, the connector's ids) of each grant this rank holds ``offer`` as: the whole grant (every
        slot of every block) first, then one grant per head slot when a block holds several."""
        units = max(self.units, 1)
        grants = [(offer.key, unit_ids(self.cache.layout, offer.block_ids, units=units, slots=range(units)))]
        if units > 1:
            grants += [(slot_key(offer.key, slot), unit_ids(self.cache.layout, offer.block_ids, units=units,
                                                            slots=(slot,))) for slot in range(units)]
        return grants

    async def _offer_all(self, metadata: KpoolPdMetadata) -> None:
        for offer in metadata.offers:
            self._offer_one(offer)
            self.stats.count("grants_offered")

    def _offer_one(self, offer) -> None:
        """Hold ``offer`` as this rank's grants (on the loop). The whole grant's end releases this request's
        own unclaimed slot grants: the keys are bound here, per offer, so that offers of one step (several
        requests' prompts computed together) never hand each other's keys to their releases."""
        rid = offer.request_id
        try:
            grants = self._grants_of(offer)
        except ValueError:
            logger.exception("request %s could not be offered: its blocks are not this engine's", rid)
            with self._lock:
                self._holding[rid] = 1
            self._grant_ended(rid)
            return
        with self._lock:
            self._holding[rid] = len(grants)
        slot_keys = tuple(key for key, _ in grants[1:])
        for index, (key, ids) in enumerate(grants):
            self._lend(offer, key, ids, slot_keys if index == 0 else ())

    def _lend(self, offer, key: str, ids: tuple[int, ...], slot_keys: tuple[str, ...]) -> None:
        """Offer one grant of ``offer`` (``key`` over the connector's ``ids``); its end counts down the
        request's grants and releases ``slot_keys`` (the whole grant's own slot grants; none for a slot
        grant). A grant that cannot be held counts as ended at once."""
        rid = offer.request_id
        try:
            allocation = self.cache.lend(rid, ids, on_release=lambda: self._grant_ended(rid, slot_keys))
        except ValueError:
            logger.exception("request %s could not be offered: its blocks are not this engine's", rid)
            self._grant_ended(rid)
            return
        try:
            self.node.offer(allocation, grant_id=key, request_id=rid, prompt_len=offer.prompt_len)
        except ValueError:
            logger.exception("request %s could not be offered; its blocks go back to vLLM", rid)
            allocation.release()

    def _grant_ended(self, request_id: str, slot_keys=()) -> None:
        """One of the request's grants ended (on the loop): once all did, its blocks are vLLM's again. The
        whole grant's end releases the slot grants no consumer rank claimed (none will pull them now)."""
        with self._lock:  # a request is in _holding or in _ended until vLLM frees it (finished_sending reads both)
            left = self._holding.get(request_id, 1) - 1
            if left > 0:
                self._holding[request_id] = left
            else:
                self._holding.pop(request_id, None)
                self._ended.add(request_id)
        if left <= 0:
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
            self._finished |= {rid for rid in finished_req_ids if rid in self._holding or rid in self._ended}
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
    vLLM's ``kv_load_failure_policy``, for the log line of a failed pull (vLLM acts on it). ``ranks`` and
    ``seat``: the engine's ranks and this worker's; ``units`` the head slots a block holds in a pool of
    head units (0: whole blocks)."""

    def __init__(self, settings: KpoolPdSettings, pool: PlanarPool, *, engine_id: str, model_identity: str,
                 failure_policy: str = "fail", ranks: EngineRanks = EngineRanks(), seat: RankSeat = RankSeat(),
                 units: int = 0) -> None:
        if failure_policy not in FAILURE_OUTCOMES:
            raise ValueError(f"kv_load_failure_policy must be one of {sorted(FAILURE_OUTCOMES)}, got {failure_policy!r}")
        if units and units != ranks.units(seat.tp_rank):
            raise ValueError(f"a pool of {units} head slots a block on TP rank {seat.tp_rank} of {seat.tp_size}, "
                             f"where the model's {ranks.total_heads} KV heads give {ranks.units(seat.tp_rank)}")
        self.settings, self.ranks, self.seat, self.units = settings, ranks, seat, units
        engine_id = seat.engine_id(engine_id)
        self.engine_id = engine_id
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
        self._renewing: dict[tuple[str, str, str], tuple[Renew, float]] = {}  # (request, address, key) -> its
        # renewal, when it is next due

    def start(self) -> None:
        self.loop.call(self.node.start)
        self.loop.submit(self._renew_forever)

    def load(self, metadata: KpoolPdMetadata) -> None:
        """Start this step's pulls and releases (they run on the loop; ``finished_recving`` reports pulls),
        and keep the grants of the requests that joined vLLM's queue alive until their load or release."""
        rank = self.seat.tp_rank
        releases = [release for release in metadata.releases if release.rank == rank]
        with self._lock:
            now = _now()
            for renew in metadata.renewals:
                if renew.rank == rank:
                    self._renewing[(renew.request_id, renew.address, renew.key)] = (renew, now + renew.lease_s / 3)
            ended = {e.request_id for e in (*metadata.loads, *metadata.releases)}
            if ended:
                self._renewing = {k: v for k, v in self._renewing.items() if k[0] not in ended}
        for load in metadata.loads:
            self.loop.submit(lambda load=load: self._pull(load))
        for release in releases:
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

    def _reads(self, load: Load) -> tuple[tuple[Read, ...], int, int]:
        """(this rank's reads of ``load``, head slots a block holds here, in the producer's ranks) in this
        pool's ids. ValueError naming the sizes for a plan this pool cannot pull (heterogeneous TP of caches
        split by head needs a pool of head units)."""
        plan = self.ranks.plan(load.producer_ranks.tp_size)
        reads = plan.reads[self.seat.tp_rank]
        if self.units:
            return reads, plan.local_units, plan.remote_units
        whole = tuple(range(plan.local_units))
        if plan.local_units != plan.remote_units or any(not r.whole or r.local_slots != whole for r in reads):
            raise ValueError(f"producer TP {plan.remote_tp} and consumer TP {plan.local_tp}: caches split by head "
                             "move between engines of other TP sizes only in vLLM's LBHNC KV cache layout "
                             "(head slots of their own), and this engine's moves whole blocks")
        return tuple(Read(remote_rank=r.remote_rank, remote_slots=(0,), local_slots=(0,), whole=True)
                     for r in reads), 1, 1

    async def _pull(self, load: Load) -> None:
        outcomes: list = []
        failed = True
        try:
            if load.error:
                raise ValueError(load.error)
            reads, local_units, remote_units = self._reads(load)
            outcomes = await asyncio.gather(*(self._pull_read(load, read, local_units, remote_units)
                                              for read in reads), return_exceptions=True)
            failures = [o for o in outcomes if isinstance(o, BaseException)]
            if failures:
                raise failures[0]
            failed = False
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
        if failed:  # the grants this rank did not pull are its to give back (a failed pull does not release one)
            await asyncio.gather(*(self._release(release) for release in self._unpulled(load, outcomes)))

    def _unpulled(self, load: Load, outcomes: list) -> list[Release]:
        """Releases of the grants this rank reads of ``load`` and did not pull (``outcomes``: each read's
        pull or its exception; empty when none ran), under the key it pulls with (its own prompt digest's;
        the producer's when the prompts differ)."""
        key = load.params.key if load.error else grant_key(load.params.grant_id, load.digest)
        try:
            reads = self.ranks.plan(load.producer_ranks.tp_size).reads[self.seat.tp_rank]
        except ValueError:  # sizes no plan serves: the one grant the params name
            return [Release(request_id=load.request_id, address=load.params.address, key=load.params.key,
                            why="its load failed")]
        if outcomes:
            reads = tuple(read for read, outcome in zip(reads, outcomes) if isinstance(outcome, BaseException))
        addresses = load.producer_ranks.addresses
        return [Release(request_id=load.request_id, address=addresses[read.remote_rank], key=read_key(key, read),
                        why="its load failed") for read in reads]

    async def _pull_read(self, load: Load, read: Read, local_units: int, remote_units: int):
        """One read of this rank: the producer rank's grant it names into this rank's slots."""
        grant, landed = rank_grant(load.params, load.digest, self.cache.layout, load.block_ids, read,
                                   local_units=local_units, remote_units=remote_units)
        peer = await self._peer(load.producer_ranks.addresses[read.remote_rank])
        slots = len(read.local_slots)  # ids a block: a held block's slots are not pulled either
        held = tuple(index * slots + k for index in load.held for k in range(slots))
        with self.cache.lend(load.request_id, landed, on_release=lambda: None) as allocation:
            pulled = await peer.pull(grant, into=allocation, transport=self.settings.transport,
                                     integrity=self.settings.integrity, held=held)
        self.stats.pulled(pulled.nbytes, pulled.regions, pulled.seconds, blocks=(len(landed) - len(held)) // slots,
                          held=len(load.held))
        return pulled

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
                due = [(key, renew) for key, (renew, at) in self._renewing.items() if at <= now]
                for key, renew in due:
                    self._renewing[key] = (renew, now + renew.lease_s / 3)
                due = [renew for _, renew in due]
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
                self._renewing.pop((renew.request_id, renew.address, renew.key), None)
        else:
            self.stats.count("grants_renewed")

    def renewing(self) -> set[str]:
        """The queued requests whose grants are being kept alive."""
        with self._lock:
            return {request_id for request_id, _, _ in self._renewing}

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
