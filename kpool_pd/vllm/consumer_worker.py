"""The consumer's worker side (``kv_consumer``): pulls producers' grants into vLLM's blocks.

A pull lands into a lent allocation of the blocks vLLM allocated for the decode request, and is reported
as finished receiving as soon as its bytes landed (and, if it failed, as failed receiving: vLLM then
recomputes the prompt or fails the request, as its ``kv_load_failure_policy`` says, for models of one KV
cache group or several). The grant's Release follows in the background (``PrefillPeer.release_soon``: sent
again until the producer answers it or the grant's lease ran out), once the pulls in flight ended (at most
``RELEASE_DEFER_S`` later), so that a pull costs one round trip before vLLM may schedule its request and
the Releases do not hold up the step's other pulls; a Release that never gets through leaves the
producer's blocks held no longer than the lease. A producer whose params say ``remote_released_after_pull``
frees the grant itself once the pull sent it all: no Release follows such a pull.

**A step's loads are one batch** (``kpool_pd.vllm.step_pulls``). Over UCX, the reads of a step's loads go to
each producer rank in one PackedPull: it checks every grant and sends their bytes in one message, and the
loads end together, so that one ``get_finished`` reports them all; a load that fails there fails alone. Over
the gRPC stream (and a load that fails before it starts) each load is a task of its own. Either way an idle
step waits for every load in flight (``kpool_pd.vllm.loop.TransferProgress``).

A consumer dials only the producers its settings allow (``KpoolPdSettings.producers``); a grant it will
not pull (a failed load, a Release from the scheduler side) is released on the producer at once. While a
request waits in vLLM's queue, its grant is renewed (``Renew``) until its load or release begins.

**Ranks.** Each TP rank's worker pulls the reads its plan gives it (``kpool_pd.vllm.ranks``), each into
the slots it holds, and acts only on the Releases and Renews addressed to its rank.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
from prometheus_client import CollectorRegistry

from kpool_pd.connector import DecodeConnector, PrefillPeer, StagingBuffers, StatusError, Transport, can_pack
from kpool_pd.kvcache import EngineCache, PlanarPool
from kpool_pd.transfer_params import grant_key
from kpool_pd.vllm.loop import ConnectorLoop, TransferProgress, connector_config, warm_staging
from kpool_pd.vllm.prefetch import Prefetches
from kpool_pd.vllm.metadata import KpoolPdMetadata, Load, Release, Renew, rank_grant, read_key
from kpool_pd.vllm.ranks import EngineRanks, RankSeat, Read
from kpool_pd.vllm.settings import KpoolPdSettings
from kpool_pd.vllm.stats import StatsRecorder
from kpool_pd.vllm.step_pulls import pull_step

logger = logging.getLogger(__name__)

RENEW_TICK_S = 0.25  # how often the consumer looks for queued requests' grants due for renewal
RELEASE_DEFER_S = 0.05  # the longest a landed grant's Release waits for the pulls in flight to end


def _now() -> float:
    return time.monotonic()


class ProducerRefused(ValueError):
    """A request named a producer this consumer's settings do not allow."""


FAILURE_OUTCOMES = {"recompute": "vLLM recomputes the prompt (kv_load_failure_policy 'recompute')",
                    "fail": "vLLM fails the request (kv_load_failure_policy 'fail')"}


class ConsumerWorker:
    """Pulls producers' grants into vLLM's blocks; releases the grants it will not pull. ``failure_policy``:
    vLLM's ``kv_load_failure_policy``, for the log line of a failed pull (vLLM acts on it). ``ranks`` and
    ``seat``: the engine's ranks and this worker's; ``units`` the head slots a block holds in a pool of
    head units (0: whole blocks); ``progress``: what vLLM's idle steps wait on (a ``kv_both`` engine's two
    sides share one)."""

    def __init__(self, settings: KpoolPdSettings, pool: PlanarPool, *, engine_id: str, model_identity: str,
                 failure_policy: str = "fail", ranks: EngineRanks = EngineRanks(), seat: RankSeat = RankSeat(),
                 units: int = 0, progress: TransferProgress | None = None) -> None:
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
        self.progress = progress or TransferProgress()
        self.stats = StatsRecorder()
        self.loop = ConnectorLoop("kpoolpd-consumer")
        self.node = DecodeConnector(pool, engine_id=engine_id, config=connector_config(settings),
                                    registry=CollectorRegistry(), transports=(settings.transport,),
                                    model_identity=model_identity)
        self._tasks: set[asyncio.Task] = set()  # pulls and releases running
        self._pulled: list[tuple[PrefillPeer, str]] = []  # grants landed, their Release not sent yet
        self._release_timer: asyncio.TimerHandle | None = None
        self._peers: dict[str, PrefillPeer] = {}
        self.unpacked: set[str] = set()  # producers that do not serve PackedPull: their reads go one at a time
        self.staging = StagingBuffers(pool.device)  # a step's batches land here before their blocks
        prefetching = settings.transport is Transport.UCX and seat.tp_size == 1
        self.prefetches = Prefetches(budget_bytes=(settings.prefetch_mib << 20) if prefetching else 0,
                                     reads_for=self.reads_for, kept=self.queued_grants,
                                     staging=StagingBuffers(pool.device), stats=self.stats,
                                     integrity=settings.integrity, rpc_timeout_s=settings.rpc_timeout_s)
        self._connecting: dict[str, asyncio.Lock] = {}
        self._renewing: dict[tuple[str, str, str], tuple[Renew, float]] = {}  # (request, address, key) -> its
        # renewal, when it is next due
        self._queued: dict[str, set[tuple[str, str]]] = {}  # request in vLLM's queue -> (address, key) of its grants

    def start(self) -> None:
        if self.settings.transport is Transport.UCX:  # PackedPull's staging: only a UCX consumer batches its loads
            warm_staging(self.staging, self.cache.pool)
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
                    self._queued.setdefault(renew.request_id, set()).add((renew.address, renew.key))
            ended = {e.request_id for e in (*metadata.loads, *metadata.releases)}
            if ended:
                self._renewing = {k: v for k, v in self._renewing.items() if k[0] not in ended}
                for request_id in ended:
                    self._queued.pop(request_id, None)
        if metadata.loads or releases:
            self.progress.begin(len(metadata.loads))  # this step's idle wait waits for them
            loads = list(metadata.loads)
            self.loop.submit(lambda: self._start_all(loads, releases))

    async def _start_all(self, loads: list[Load], releases: list[Release]) -> None:
        """One hand-over a step: its UCX loads start as one batch (``pull_step``), every other load and release
        as a task of its own."""
        batched = [load for load in loads if self.settings.transport is Transport.UCX and not load.error]
        work = [self._pull(load) for load in loads if load not in batched] + [self._release(r) for r in releases]
        if batched:
            work.append(pull_step(self, batched))
        for coroutine in work:
            task = asyncio.ensure_future(coroutine)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def peer(self, address: str) -> PrefillPeer:
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
                if can_pack(peer):
                    self.prefetches.follow(peer)  # the grants it announces to this engine come early
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

    def reads_of(self, load: Load) -> tuple[tuple[Read, ...], int, int]:
        """(this rank's reads of ``load``, head slots a block holds here, in the producer's ranks) in this
        pool's ids: ``reads_for`` its producer's TP size."""
        return self.reads_for(load.producer_ranks.tp_size)

    def reads_for(self, producer_tp: int) -> tuple[tuple[Read, ...], int, int]:
        """(this rank's reads of a request from a producer of ``producer_tp`` ranks, head slots a block holds
        here, in the producer's ranks) in this pool's ids. ValueError naming the sizes for a plan this pool
        cannot pull (heterogeneous TP of caches split by head needs a pool of head units)."""
        plan = self.ranks.plan(producer_tp)
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
            reads, local_units, remote_units = self.reads_of(load)
            outcomes = await asyncio.gather(*(self.pull_read(load, read, local_units, remote_units)
                                              for read in reads), return_exceptions=True)
            failures = [o for o in outcomes if isinstance(o, BaseException)]
            if failures:
                raise failures[0]
            failed = False
        except Exception as exc:  # every failure: vLLM recomputes or fails the request (reported below)
            logger.warning("KV transfer of request %s failed, %s: %s", load.request_id, self.failure_outcome, exc)
        finally:
            self._report([(load, failed)])
        if failed:  # the grants this rank did not pull are its to give back (a failed pull does not release one)
            await asyncio.gather(*(self._release(release) for release in self._unpulled(load, outcomes)))

    def ended(self, loads: list[tuple[Load, BaseException | None, list]]) -> None:
        """Loads of one batch ended, each with why it could not start (or None) and its reads' outcomes (what
        landed, or the exception): all are reported to vLLM together, and the grants the failed ones did not
        pull are given back."""
        report = []
        for load, error, outcomes in loads:
            failures = [error] if error is not None else [o for o in outcomes if isinstance(o, BaseException)]
            if failures:
                logger.warning("KV transfer of request %s failed, %s: %s", load.request_id, self.failure_outcome,
                               failures[0])
                releases = self._unpulled(load, [] if error is not None else outcomes)
                for release in releases:
                    task = asyncio.ensure_future(self._release(release))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            report.append((load, bool(failures)))
        self._report(report)

    def _report(self, loads: list[tuple[Load, bool]]) -> None:
        """Loads ended (each, whether it failed): the next ``finished_recving`` reports them all at once."""
        with self._lock:
            for load, failed in loads:
                self._received.add(load.request_id)
                if failed:
                    self._failed.add(load.request_id)
        for load, failed in loads:
            if failed:
                self.stats.count("pull_failures")
            self.progress.end()
        if self.progress.in_flight <= 0:
            self._send_releases()

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

    async def pull_read(self, load: Load, read: Read, local_units: int, remote_units: int):
        """One read of this rank: the producer rank's grant it names into this rank's slots."""
        grant, landed = rank_grant(load.params, load.digest, self.cache.layout, load.block_ids, read,
                                   local_units=local_units, remote_units=remote_units)
        peer = await self.peer(load.producer_ranks.addresses[read.remote_rank])
        slots = len(read.local_slots)  # ids a block: a held block's slots are not pulled either
        held = tuple(index * slots + k for index in load.held for k in range(slots))
        with self.cache.lend(load.request_id, landed, on_release=lambda: None) as allocation:
            pulled = await peer.pull(grant, into=allocation, transport=self.settings.transport,
                                     integrity=self.settings.integrity, held=held, release=False)
        if not load.released_after_pull:  # the producer freed it as its last byte went out
            self.release_after_pulls(peer, grant.grant_id)  # landed: vLLM hears of it now
        self.stats.pulled(pulled.nbytes, pulled.regions, pulled.seconds, blocks=(len(landed) - len(held)) // slots,
                          held=len(load.held))
        return pulled

    def release_after_pulls(self, peer: PrefillPeer, grant_id: str) -> None:
        """Release a pulled grant once no pull is in flight, or ``RELEASE_DEFER_S`` from now if pulls keep
        coming: the pulls of a step go first. ``PrefillPeer.release_soon`` sends it until the producer answers
        or the grant's lease ran out."""
        self._pulled.append((peer, grant_id))
        if self._release_timer is None:
            self._release_timer = self.loop.loop.call_later(RELEASE_DEFER_S, self._send_releases)

    def _send_releases(self) -> None:
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None
        pulled, self._pulled = self._pulled, []
        for peer, grant_id in pulled:
            peer.release_soon(grant_id)

    async def _release(self, release: Release, peer: PrefillPeer | None = None) -> None:
        """Release a grant on its producer, best effort: a failure is logged, and the lease frees it."""
        try:
            peer = peer if peer is not None and not peer.closed else await self.peer(release.address)
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
            peer = await self.peer(renew.address)
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

    def queued_grants(self) -> set[tuple[str, str]]:
        """(producer address, grant key) of every grant a request in vLLM's queue here names (until its load or
        release), whether or not the producer still holds it (a prefetch may have freed it there)."""
        with self._lock:
            return {grant for grants in self._queued.values() for grant in grants}

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
        async def stop():
            self.prefetches.close()
            await self.node.close()
        try:
            self.loop.call(stop)
        finally:
            self.loop.close()
