"""The grants a prefill node holds: who may pull, release or renew each, their reaping and freeing, and the
Release and Heartbeat RPCs.

A grant belongs to the handshaken decode engine whose Prefill made it (``PrefillRequest.engine_id``), or to
the ranks of the DCP instance it named: Pull, Release and Heartbeat naming another engine's grant are
refused PERMISSION_DENIED and touch nothing (no byte sent, no lease renewed or released). A grant is freed
(the engine's allocation released, a computation still running stopped first) once it was released or its
lease ran out and no pull reads it; the reaper (``run_reaper``) looks every tenth of a lease, and also
forgets the decode engines gone silent (``DecodeEngineTable.forget_silent``).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kpool_pd.connector import prefill_api as pb
from kpool_pd.connector.prefill.decode_engines import MAX_ID_CHARS, DecodeEngine, DecodeEngineTable
from kpool_pd.connector.prefill.engine import PrefillProgress
from kpool_pd.connector.prefill.leases import Grant, LeaseTable
from kpool_pd.connector.shared.config import ConnectorConfig
from kpool_pd.connector.shared.errors import StatusError
from kpool_pd.connector.shared.metrics import ConnectorMetrics
from kpool_pd.connector.shared.plan import ring_live_range
from kpool_pd.kvcache import CacheAllocation

logger = logging.getLogger(__name__)


class GrantKeeper:
    """The node's grants under lease (``leases``). Not thread-safe: the node's event loop only."""

    def __init__(self, config: ConnectorConfig, metrics: ConnectorMetrics, engines: DecodeEngineTable) -> None:
        self.config, self.metrics, self.engines = config, metrics, engines
        self.leases = LeaseTable(config.lease_s)
        self._reaper: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self.leases)

    # freeing -----------------------------------------------------------------------------
    def free(self, grant: Grant) -> None:
        """Release a grant's allocation (the engine's handle); a computation still running is stopped first
        (the engine writes nothing into it afterwards that a later request could read: see
        ``kpool_pd.connector.prefill.engine``)."""
        if grant.computing:
            grant.failure = grant.failure or "its grant was freed"
            grant.prefill.cancel()
        grant.progress.release()

    def reap(self) -> int:
        """Free expired and released grants that no pull reads; returns how many expired."""
        expired = 0
        for grant in self.leases.take_expired():
            if not grant.release_requested:
                expired += 1
                self.metrics.leases_expired.inc()
                logger.warning("lease of grant %s (request %s) expired; freeing %d blocks",
                               grant.grant_id, grant.request_id, len(grant.block_ids))
            self.free(grant)
        return expired

    def start_reaper(self) -> None:
        """Start the reaper task on the running loop (idempotent)."""
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever(), name="lease-reaper")

    async def stop(self) -> None:
        """Stop the reaper and free every grant (idempotent). The caller stopped the server first, so that
        no RPC reads the blocks being freed."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None
        for grant in self.leases.pop_all():
            self.free(grant)

    async def _reap_forever(self) -> None:
        period = min(max(self.config.lease_s / 10, 0.02), 1.0)
        while True:
            await asyncio.sleep(period)
            self.reap()
            self.engines.forget_silent()

    # grants the engine offers itself -----------------------------------------------------
    def offer(self, allocation: CacheAllocation, *, grant_id: str, request_id: str, prompt_len: int,
              first_token: int = 0) -> Grant:
        """Hold ``allocation`` (a prompt the engine computed on its own: an engine that schedules its own
        requests, vLLM's producer) as a grant under lease, claimed by the first handshaken decode engine
        that names it (``claim``). ValueError for a grant id in use, a bad length or a released allocation."""
        if not grant_id or len(grant_id) > MAX_ID_CHARS or not request_id or len(request_id) > MAX_ID_CHARS:
            raise ValueError(f"grant and request ids must have 1 to {MAX_ID_CHARS} characters, "
                             f"got {grant_id[:16]!r} and {request_id[:16]!r}")
        if type(prompt_len) is not int or not 1 <= prompt_len <= self.config.max_prompt_tokens:
            raise ValueError(f"prompt_len must be 1 to {self.config.max_prompt_tokens}, got {prompt_len!r}")
        if grant_id in self.leases:
            raise ValueError(f"grant id {grant_id[:16]}... is in use")
        progress = PrefillProgress(request_id)
        progress.serve_from(allocation)
        progress.advance(prompt_len)
        layout = allocation.pool.layout
        grant = Grant(grant_id=grant_id, request_id=request_id, engine_id="", block_ids=allocation.block_ids,
                      ring_id=0 if allocation.ring_id is None else allocation.ring_id, prompt_len=prompt_len,
                      live=ring_live_range(layout.config, prompt_len), first_token=first_token,
                      expires_at=self.leases.expiry(), progress=progress)
        self.leases.add(grant)
        return grant

    def claim(self, grant: Grant, engine_id: str) -> None:
        """An offered grant nobody claimed yet becomes ``engine_id``'s, if that engine has handshaken; from
        then on it is that engine's alone, as a grant its own Prefill made."""
        if not grant.engine_id and engine_id in self.engines:
            grant.engine_id = engine_id

    # who may touch a grant ---------------------------------------------------------------
    @staticmethod
    def pulls_as(grant: Grant, engine_id: str, dcp_rank: int) -> bool:
        """Whether ``engine_id`` (as DCP rank ``dcp_rank``) may pull or release (its share of) ``grant``."""
        if not grant.dcp_engine_ids:
            return grant.engine_id == engine_id
        return dcp_rank < len(grant.dcp_engine_ids) and grant.dcp_engine_ids[dcp_rank] == engine_id

    def foreign(self, what: str, engine_id: str, count: int = 1) -> StatusError:
        """PERMISSION_DENIED, counted and logged: ``engine_id`` named ``count`` grants made for another
        engine (which one is not said)."""
        self.metrics.failures.labels("foreign_grant").inc()
        logger.warning("%s by engine %r refused: %d grant%s of another engine", what, engine_id[:MAX_ID_CHARS], count,
                       "" if count == 1 else "s")
        return StatusError(grpc.StatusCode.PERMISSION_DENIED,
                           f"{what}: {count} grant{'' if count == 1 else 's'} not made for engine "
                           f"{engine_id[:MAX_ID_CHARS]!r}")

    def authenticate(self, engine_id: str, secret: bytes, what: str) -> DecodeEngine:
        """``DecodeEngineTable.authenticate``, a refusal counted (``engine_secret``)."""
        try:
            return self.engines.authenticate(engine_id, secret, what)
        except StatusError as exc:
            if exc.code is grpc.StatusCode.PERMISSION_DENIED:
                self.metrics.failures.labels("engine_secret").inc()
            raise

    # RPCs --------------------------------------------------------------------------------
    def release(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        """The Release RPC: the grant (a DCP rank's share, or every rank's) is released and freed once no
        pull reads it; a computation still running is stopped. False for an unknown grant; StatusError
        PERMISSION_DENIED for another engine's or without the engine's secret, FAILED_PRECONDITION from an
        engine not handshaken.

        A Release that names no engine (``engine_id`` empty) releases an offered grant no engine has claimed
        yet (``offer``): a PD router whose decode could not happen gives the producer's blocks back at once.
        The caller has passed the peer credential, and the grant id (128 random bits, which only the
        request's own params carry) is the claim; a claimed grant is refused PERMISSION_DENIED."""
        if not request.engine_id:
            return self._release_unclaimed(request.grant_id)
        self.authenticate(request.engine_id, request.engine_secret, "Release")
        grant = self.leases.live(request.grant_id)
        if grant is None:
            return pb.ReleaseResponse(released=False)
        self.claim(grant, request.engine_id)
        if not self.pulls_as(grant, request.engine_id, request.dcp_rank) or (request.all_ranks and request.dcp_rank != 0):
            raise self.foreign("Release", request.engine_id)
        if grant.dcp_engine_ids and not request.all_ranks:
            grant.release_rank(request.dcp_rank)
        else:
            grant.release_requested = True
        if grant.release_requested and grant.computing:  # nobody wants the rest of the prompt: a pull still
            self.stop_computing(grant, "its grant was released")  # reading it fails at once
        self.reap()  # frees it now unless a pull still reads it (then when that pull ends)
        return pb.ReleaseResponse(released=True)

    def _release_unclaimed(self, grant_id: str) -> pb.ReleaseResponse:
        grant = self.leases.live(grant_id)
        if grant is None:
            return pb.ReleaseResponse(released=False)
        if grant.engine_id or grant.dcp_engine_ids:
            raise self.foreign("Release", "")
        logger.info("offered grant %s (request %s) released unclaimed; freeing %d blocks", grant.grant_id,
                    grant.request_id, len(grant.block_ids))
        grant.release_requested = True
        self.reap()
        return pb.ReleaseResponse(released=True)

    def abandon(self, grant: Grant, why: str) -> None:
        """Release a grant whose decode engine went away (its pull's stream was cancelled or broke while the
        prompt was still being computed): the engine stops before its next chunk and the grant is freed
        once no pull reads it, rather than at the end of its lease."""
        logger.warning("grant %s (request %s) abandoned: %s; stopping its prefill", grant.grant_id,
                       grant.request_id, why)
        self.metrics.failures.labels("abandoned").inc()
        grant.release_requested = True
        self.stop_computing(grant, why)
        self.reap()

    @staticmethod
    def stop_computing(grant: Grant, why: str) -> None:
        """Cancel a grant's computation still running (the engine drops its remaining chunks); a pull waiting
        on it fails with ``why``."""
        if grant.computing:
            grant.failure = grant.failure or why
            grant.prefill.cancel()

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        """The Heartbeat RPC: renew the grants named (checked first: a refused call renews none), note the
        engine heard from, and say which grants are gone and whether the engine is known. PERMISSION_DENIED
        for a known engine without its secret (an unknown one is told so, and handshakes again)."""
        if len(request.grant_ids) > self.config.max_grants:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{len(request.grant_ids)} grant ids (limit {self.config.max_grants})")
        if request.engine_id in self.engines:
            self.authenticate(request.engine_id, request.engine_secret, "Heartbeat")
        for grant_id in request.grant_ids:
            if (grant := self.leases.live(grant_id)) is not None:
                self.claim(grant, request.engine_id)
        foreign = [g for g in request.grant_ids
                   if (grant := self.leases.live(g)) is not None and not grant.owned_by(request.engine_id)]
        if foreign:
            raise self.foreign("Heartbeat", request.engine_id, len(foreign))
        unknown = [g for g in request.grant_ids if not self.leases.renew(g)]
        self.engines.heard_from(request.engine_id)
        return pb.HeartbeatResponse(unknown_grant_ids=unknown, lease_ms=int(self.config.lease_s * 1000),
                                    engine_unknown=request.engine_id not in self.engines)
