"""A consumer's prefetch: the grants producers announce to it by name, pulled before their decode requests arrive.

A proxy that knows where a request will decode names that consumer in the producer request
(``{"do_remote_decode": true, "prefetch_by": "<the consumer's vLLM engine_id>"}``). The producer announces the
grant to that consumer as soon as it holds it (``AwaitOffers``, ``kpool_pd.connector.OfferBoard``), with the
``kv_transfer_params`` the decode request will carry; the consumer pulls it at once into memory of its own
(``kpool_pd.connector.prefetch_packed``), while the proxy is still on its way. When the decode request's load
comes, the step's batch (``kpool_pd.vllm.step_pulls``) copies those bytes into its blocks instead of pulling them.
The prefetch is the grant's pull: a producer that frees a grant once a pull sent it all (``release_after_pull``,
the default) frees it then, and its blocks are vLLM's again before the decode request even arrives; otherwise the
load's Release follows as after any pull. So a request the proxy then sends to another consumer than the one it
named finds no grant there: that consumer recomputes its prompt (or fails it, as its ``kv_load_failure_policy``
says), as when a grant's lease ran out.

Nothing changes for a request whose bytes are not here: it is pulled as before. Prefetched bytes count against
``prefetch_mib`` (announcements beyond it are left to their pulls), are never written into a block before a load
of this engine claims them under the same key (the grant bound to the prompt's digest: a load of another prompt
does not match), and are dropped once their grant's lease has passed unclaimed, unless a request queued here
names them (``kept``: a queued request never loses its prompt, however long the queue). A consumer follows each
producer it has handshaken with (one ``AwaitOffers`` call waiting at a time); only consumers of one TP rank
prefetch, and only producers of one TP rank announce.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Callable

import grpc

from kpool_pd.connector import PrefillPeer, Prefetched, StagingBuffers
from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector import prefetch_packed, whole_plan
from kpool_pd.transfer_params import DecodeParams
from kpool_pd.vllm.metadata import rank_grant
from kpool_pd.vllm.rank_params import RankParams
from kpool_pd.vllm.ranks import Read
from kpool_pd.vllm.stats import StatsRecorder

logger = logging.getLogger(__name__)

WAIT_MS = 5000  # how long one AwaitOffers call waits for an announcement
RETRY_S = 1.0  # after a failed AwaitOffers call, the wait before the next
MAX_LOADED = 4096  # grants remembered as pulled by their loads (an announcement of one coming late is ignored)


class Prefetches:
    """The prefetched grants of one consumer rank, by (producer address, grant key), and the loops that fetch them
    (on the connector's event loop only). ``budget_bytes``: the most held at once; ``reads_for``: the consumer
    rank's reads of a producer of that many TP ranks (``ConsumerWorker.reads_for``); ``kept``: the (producer
    address, grant key) of the requests queued in vLLM here (``ConsumerWorker.queued_grants``), never expired."""

    def __init__(self, *, budget_bytes: int, reads_for: Callable[[int], tuple[tuple[Read, ...], int, int]],
                 kept: Callable[[], set[tuple[str, str]]], staging: StagingBuffers, stats: StatsRecorder,
                 integrity: bool, rpc_timeout_s: float) -> None:
        self.budget_bytes, self.reads_for, self.kept = budget_bytes, reads_for, kept
        self.staging, self.stats = staging, stats
        self.integrity, self.rpc_timeout_s = integrity, rpc_timeout_s
        self._held: dict[tuple[str, str], Prefetched] = {}
        self._coming: dict[tuple[str, str], asyncio.Future] = {}  # being pulled: resolves to the entry or None
        self._lease_s: dict[tuple[str, str], float] = {}
        self._following: dict[str, asyncio.Task] = {}
        self._room = asyncio.Event()
        self._loaded: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()  # the latest
        # MAX_LOADED grants a load pulled itself (none was here): announced later, they are not prefetched

    @property
    def held_bytes(self) -> int:
        return sum(entry.nbytes for entry in self._held.values())

    def follow(self, peer: PrefillPeer) -> None:
        """Start waiting for ``peer``'s announcements (once a peer; again after a loop of a closed peer ended)."""
        running = self._following.get(peer.address)
        if self.budget_bytes <= 0 or (running is not None and not running.done()):
            return
        self._following[peer.address] = asyncio.ensure_future(self._follow(peer))

    async def _follow(self, peer: PrefillPeer) -> None:
        """AwaitOffers on ``peer`` until it closes (or does not serve the call), prefetching what fits; a fault
        of this code is logged and the loop goes on after ``RETRY_S`` (the loads then pull as before)."""
        while not peer.closed:
            try:
                if not await self._follow_once(peer):
                    return
            except Exception:
                logger.exception("following %s's announcements failed; trying again in %s s", peer.address, RETRY_S)
                await asyncio.sleep(RETRY_S)

    async def _follow_once(self, peer: PrefillPeer) -> bool:
        """One AwaitOffers call on ``peer`` and the prefetch of what it announced; False once the peer does not
        serve the call."""
        self.expire()
        if self.held_bytes >= self.budget_bytes:
            self._room.clear()
            try:
                await asyncio.wait_for(self._room.wait(), RETRY_S)
            except asyncio.TimeoutError:
                pass
            return True
        try:
            answer = await peer._stub.AwaitOffers(
                pb.AwaitOffersRequest(engine_id=peer.context.engine_id, wait_ms=WAIT_MS,
                                      engine_secret=peer.context.secrets.get(peer.address)),
                timeout=WAIT_MS / 1000 + self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                logger.info("producer %s announces no grants (AwaitOffers): nothing is prefetched from it",
                            peer.address)
                return False
            logger.debug("AwaitOffers on %s: %s", peer.address, exc.details())
            await asyncio.sleep(RETRY_S)
            return True
        if answer.offers:
            await self._fetch(peer, list(answer.offers))
        return True

    def _grant(self, peer: PrefillPeer, offer) -> tuple[object, float]:
        """The grant an announcement names (as its decode request's load will name it) and its lease; ValueError
        for params that fail their checks or name another producer or key."""
        raw = json.loads(offer.params_json)
        params, ranks = DecodeParams.parse(raw), RankParams.parse(raw)
        if params.address != peer.address or ranks.addresses != (peer.address,):
            raise ValueError(f"announced by {peer.address} for {list(ranks.addresses)}")
        reads, local_units, remote_units = self.reads_for(ranks.tp_size)
        if len(reads) != 1 or not reads[0].whole:
            raise ValueError(f"this rank reads {len(reads)} shares of a producer of {ranks.tp_size} ranks")
        grant, _ = rank_grant(params, params.prompt_digest, peer.context.pool.layout, params.block_ids, reads[0],
                              local_units=local_units, remote_units=remote_units)
        if grant.grant_id != offer.grant_id:
            raise ValueError(f"announced as {offer.grant_id!r}, its params name {grant.grant_id!r}")
        return grant, params.lease_s

    async def _fetch(self, peer: PrefillPeer, offers: list) -> None:
        """Prefetch the announced grants that fit the budget, in one PackedPull."""
        grants, room = [], self.budget_bytes - self.held_bytes
        for offer in offers:
            try:
                grant, lease_s = self._grant(peer, offer)
            except ValueError as exc:
                logger.warning("announcement of grant %r by %s ignored: %s", offer.grant_id[:64], peer.address, exc)
                continue
            key = (peer.address, grant.grant_id)
            if key in self._held or key in self._coming or key in self._loaded:
                continue
            try:
                plan = whole_plan(peer, grant)
            except ValueError as exc:
                logger.warning("announced grant %s from %s cannot be planned (its load pulls it): %s",
                               grant.grant_id[:32], peer.address, exc)
                continue
            if plan.total_bytes > room:
                self.stats.count("prefetches_skipped")
                continue
            room -= plan.total_bytes
            grants.append((grant, plan))
            self._lease_s[key] = lease_s
            self._coming[key] = asyncio.get_running_loop().create_future()
        if not grants:
            return
        try:
            try:
                outcomes = await prefetch_packed(peer, grants, staging=self.staging, integrity=self.integrity)
            except Exception as exc:  # every grant is left to its pull
                logger.warning("prefetch of %d grants from %s failed: %s", len(grants), peer.address, exc)
                outcomes = [exc] * len(grants)
            for (grant, _), outcome in zip(grants, outcomes):
                key = (peer.address, grant.grant_id)
                entry = outcome if isinstance(outcome, Prefetched) else None
                if entry is not None:
                    self._held[key] = entry
                    self.stats.count("grants_prefetched")
                else:
                    self._lease_s.pop(key, None)
                    logger.info("grant %s from %s not prefetched (its load pulls it): %s", grant.grant_id[:32],
                                peer.address, outcome)
                self._settle(key, entry)
        finally:  # however this ends (cancelled included), no load waits for a prefetch that will not come
            for grant, _ in grants:
                self._settle((peer.address, grant.grant_id), None)

    def _settle(self, key: tuple[str, str], entry: Prefetched | None) -> None:
        """The prefetch of ``key`` ended (``entry``: what it holds, None: nothing): a load waiting for it goes on."""
        coming = self._coming.pop(key, None)
        if coming is not None and not coming.done():
            coming.set_result(entry)

    async def claim(self, address: str, key: str, timeout_s: float) -> Prefetched | None:
        """The entry of grant ``key`` from ``address``, no longer held here (the caller lands or drops it): at
        once, or once its prefetch in flight ended (at most ``timeout_s``); None where there is none."""
        at = (address, key)
        coming = self._coming.get(at)
        if coming is not None:
            try:
                await asyncio.wait_for(asyncio.shield(coming), timeout_s)
            except asyncio.TimeoutError:
                return None
        entry = self._held.pop(at, None)
        self._lease_s.pop(at, None)
        if entry is not None:
            self._room.set()
        return entry

    def has(self, address: str, key: str) -> bool:
        return (address, key) in self._held or (address, key) in self._coming

    def loading(self, address: str, key: str) -> None:
        """A load pulls grant ``key`` from ``address`` itself: an announcement of it that comes later is ignored
        (its pull has it, or will). Nothing to remember where this rank does not prefetch."""
        if self.budget_bytes <= 0:
            return
        self._loaded[(address, key)] = None
        self._loaded.move_to_end((address, key))
        while len(self._loaded) > MAX_LOADED:
            self._loaded.popitem(last=False)

    def expire(self, now: float | None = None) -> int:
        """Drop the entries held longer than their grant's lease that no request queued here names (``kept``,
        set by the consumer: its queued requests' (producer address, grant key)); returns how many."""
        now = time.monotonic() if now is None else now
        kept = self.kept()
        stale = [key for key, entry in self._held.items()
                 if now - entry.landed_at > self._lease_s.get(key, 0.0) and key not in kept]
        for key in stale:
            self._held.pop(key).drop()
            self._lease_s.pop(key, None)
            self.stats.count("prefetches_expired")
        if stale:
            self._room.set()
        return len(stale)

    def close(self) -> None:
        """Stop following every producer and drop what is held."""
        for task in self._following.values():
            task.cancel()
        self._following.clear()
        for entry in self._held.values():
            entry.drop()
        self._held.clear()
        self._lease_s.clear()
