"""A consumer's UCX loads of one engine step as one batch a producer rank (``kpool_pd.connector.pull_packed``).

``pull_step(worker, loads)`` finds the peers the loads read from (handshaking those not known yet, all at
once), lends each read its blocks and sends the reads of each producer rank in one PackedPull: the producer
checks every grant as a pull of its own, sends their bytes in one message, and the worker copies each into its
blocks. The loads then end together (``ConsumerWorker.ended``): one ``get_finished`` reports the whole batch.

A load fails alone, with the reason logged, and what its rank did not pull is released: a refused grant, a plan
its blocks cannot take, bytes that disagree with the plan; the other loads of the batch land. A producer that
does not serve PackedPull (or a peer that needs a repack, or one that could not be reached) has its reads
pulled one at a time (``ConsumerWorker.pull_read``), as before. A read whose grant was prefetched
(``kpool_pd.vllm.prefetch``) lands from those bytes instead, and its grant is released after.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from kpool_pd.connector import (PackedLanded, PackedPullUnsupported, PackedTarget, PrefillPeer, StagingBuffers, can_pack,
                                pull_packed)
from kpool_pd.kvcache import CacheAllocation, EngineCache
from kpool_pd.vllm.metadata import Load, rank_grant
from kpool_pd.vllm.prefetch import Prefetches
from kpool_pd.vllm.ranks import Read
from kpool_pd.vllm.settings import KpoolPdSettings
from kpool_pd.vllm.stats import StatsRecorder

logger = logging.getLogger(__name__)


class StepWorker(Protocol):
    """What a step's batch needs of its consumer worker (``kpool_pd.vllm.consumer_worker.ConsumerWorker``)."""

    cache: EngineCache
    settings: KpoolPdSettings
    stats: StatsRecorder
    staging: StagingBuffers
    unpacked: set[str]  # producers that do not serve PackedPull
    prefetches: Prefetches

    async def peer(self, address: str) -> PrefillPeer: ...

    def reads_of(self, load: Load) -> tuple[tuple[Read, ...], int, int]: ...

    def ended(self, loads: list[tuple[Load, BaseException | None, list]]) -> None: ...

    async def pull_read(self, load: Load, read: Read, local_units: int, remote_units: int): ...

    def release_after_pulls(self, peer: PrefillPeer, grant_id: str) -> None: ...


@dataclass
class _StepRead:
    """One read of one load in the step's batch: where it lands and, once pulled, how it ended."""

    load: Load
    read: Read
    units: tuple[int, int]  # (local, remote) head slots a block
    address: str
    outcome: object = None  # PackedLanded, the pull's LandedRequest (pulled alone), or the exception
    allocation: CacheAllocation | None = None
    target: PackedTarget | None = None
    prefetched: bool = False  # landed from a prefetch: its grant (kept by the producer) is released after


async def pull_step(worker: StepWorker, loads: list[Load]) -> None:
    """Pull ``loads`` (this step's, none with an error) and end them together; see the module. A fault of this
    code fails them all (logged), so that none waits for ever."""
    try:
        ended = await _pulled(worker, loads)
    except Exception as exc:
        logger.exception("the batch of %d loads failed", len(loads))
        ended = [(load, exc, []) for load in loads]
    worker.ended(ended)


async def _pulled(worker: StepWorker, loads: list[Load]) -> list[tuple[Load, BaseException | None, list]]:
    """Each load of ``loads`` with why it could not start (or None) and its reads' outcomes."""
    reads: list[_StepRead] = []
    failed: dict[str, BaseException] = {}  # request -> why no read of it could start
    for load in loads:
        try:
            plan, local_units, remote_units = worker.reads_of(load)
        except ValueError as exc:
            failed[load.request_id] = exc
            continue
        addresses = load.producer_ranks.addresses
        reads += [_StepRead(load, read, (local_units, remote_units), addresses[read.remote_rank]) for read in plan]
    peers = await _peers(worker, {r.address for r in reads})
    by_peer: dict[str, list[_StepRead]] = {}
    alone: list[_StepRead] = []
    prefetched: list[_StepRead] = []
    for step_read in reads:
        peer = peers.get(step_read.address)
        if isinstance(peer, PrefillPeer) and can_pack(peer) and step_read.address not in worker.unpacked:
            _lend(worker, step_read)
            if step_read.target is None:
                continue
            if worker.prefetches.has(step_read.address, step_read.target.grant.grant_id):
                prefetched.append(step_read)
            else:
                worker.prefetches.loading(step_read.address, step_read.target.grant.grant_id)
                by_peer.setdefault(step_read.address, []).append(step_read)
        else:
            alone.append(step_read)
    try:
        await asyncio.gather(_land_or_pull(worker, peers, prefetched),
                             *(_pull_packed(worker, peers[address], group) for address, group in by_peer.items()),
                             *(_pull_alone(worker, r) for r in alone))
    finally:
        for step_read in reads:
            if step_read.allocation is not None:
                step_read.allocation.release()
    for step_read in reads:  # the landed grants' Releases (a producer that frees them itself after a pull needs none)
        if isinstance(step_read.outcome, PackedLanded) and (step_read.prefetched
                                                            or not step_read.load.released_after_pull):
            worker.release_after_pulls(peers[step_read.address], step_read.target.grant.grant_id)
    outcomes: dict[str, list] = {load.request_id: [] for load in loads}
    for step_read in reads:
        outcomes[step_read.load.request_id].append(step_read.outcome)
    return [(load, failed.get(load.request_id), outcomes[load.request_id]) for load in loads]


async def _land_or_pull(worker: StepWorker, peers: dict, prefetched: list[_StepRead]) -> None:
    """Land the reads whose grants were prefetched (waiting for prefetches in flight, beside the step's other
    pulls); those whose bytes are not here after all are pulled then, one PackedPull a producer rank."""
    landed = await asyncio.gather(*(_land_prefetched(worker, peers[r.address], r) for r in prefetched))
    missed: dict[str, list[_StepRead]] = {}
    for step_read, done in zip(prefetched, landed):
        if not done:
            missed.setdefault(step_read.address, []).append(step_read)
    await asyncio.gather(*(_pull_packed(worker, peers[address], group) for address, group in missed.items()))


async def _peers(worker: StepWorker, addresses: set[str]) -> dict[str, PrefillPeer | BaseException]:
    """The peer at each address (handshaken at once where new), or why it could not be had."""
    ordered = sorted(addresses)
    found = await asyncio.gather(*(worker.peer(address) for address in ordered), return_exceptions=True)
    return dict(zip(ordered, found))


def _lend(worker: StepWorker, step_read: _StepRead) -> None:
    """Lend a read its blocks and make its target; a read that cannot be planned fails alone (its outcome)."""
    load, read = step_read.load, step_read.read
    local_units, remote_units = step_read.units
    try:
        grant, landed = rank_grant(load.params, load.digest, worker.cache.layout, load.block_ids, read,
                                   local_units=local_units, remote_units=remote_units)
        slots = len(read.local_slots)  # ids a block: a held block's slots are not pulled either
        held = tuple(index * slots + k for index in load.held for k in range(slots))
        step_read.allocation = worker.cache.lend(load.request_id, landed, on_release=lambda: None)
    except ValueError as exc:
        step_read.outcome = exc
        return
    step_read.target = PackedTarget(grant=grant, into=step_read.allocation, held=held)


async def _land_prefetched(worker: StepWorker, peer: PrefillPeer, step_read: _StepRead) -> bool:
    """Land a read from its grant's prefetched bytes (waiting for a prefetch in flight, within the pull's bound);
    False where they are not here (never came, dropped, or a plan they cannot serve: the read is then pulled)."""
    key = step_read.target.grant.grant_id
    entry = await worker.prefetches.claim(peer.address, key, worker.settings.pull_timeout_s)
    if entry is None:
        return False
    try:
        plan = entry.land(peer, step_read.target)
    except ValueError as exc:
        entry.drop()
        logger.warning("prefetched grant %s of request %s not used (pulled instead): %s", key[:32],
                       step_read.load.request_id, exc)
        return False
    step_read.outcome = PackedLanded(plan.total_bytes, len(plan), entry.seconds)
    step_read.prefetched = True
    slots = len(step_read.read.local_slots)
    worker.stats.count("prefetch_hits")
    worker.stats.pulled(plan.total_bytes, len(plan), entry.seconds, held=len(step_read.load.held),
                        blocks=(len(step_read.target.into.block_ids) - len(step_read.target.held)) // slots)
    return True


async def _pull_packed(worker: StepWorker, peer: PrefillPeer, group: list[_StepRead]) -> None:
    """One PackedPull of ``group`` (one producer rank's reads); a producer that does not serve it has them
    pulled alone, and is not asked again."""
    try:
        outcomes = await pull_packed(peer, [r.target for r in group], staging=worker.staging,
                                     integrity=worker.settings.integrity)
    except PackedPullUnsupported:
        worker.unpacked.add(peer.address)
        logger.info("producer %s does not serve PackedPull: its reads are pulled one at a time", peer.address)
        for step_read in group:
            step_read.allocation.release()
            step_read.allocation = step_read.target = None
        await asyncio.gather(*(_pull_alone(worker, r) for r in group))
        return
    for step_read, outcome in zip(group, outcomes):
        step_read.outcome = outcome
        if isinstance(outcome, PackedLanded):
            load, target = step_read.load, step_read.target
            slots = len(step_read.read.local_slots)
            worker.stats.pulled(outcome.nbytes, outcome.regions, outcome.seconds,
                                blocks=(len(target.into.block_ids) - len(target.held)) // slots, held=len(load.held))


async def _pull_alone(worker: StepWorker, step_read: _StepRead) -> None:
    try:
        step_read.outcome = await worker.pull_read(step_read.load, step_read.read, *step_read.units)
    except Exception as exc:  # the load fails (reported with the others)
        step_read.outcome = exc
