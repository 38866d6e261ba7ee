"""A DCP decode rank other than rank 0: its share of the cache, its own connector, and the service
rank 0 drives it through (``kpoolpd.v1.DcpRankService``).

Rank 0 (the decode daemon with ``--dcp N``) starts ranks 1..N-1 as ``python -m kpool_pd.decode_worker.dcp_rank``
with its own settings, ``--dcp-rank``, the group's rendezvous and the instance's secret (the rank's
client token: the service takes nothing else). A rank joins the group (``model.DcpGroup``, over
loopback), serves the service on loopback only, and writes its ready file. It holds a
request from Land (its pull of its share from the prefill node, which releases its share of the
grant) until the Step that finishes it (after its state digest) or Drop. A collective
that fails (a rank died) breaks the rank for good: it frees every request it holds and answers
every later Land or Step UNAVAILABLE; rank 0 then fails the requests and stops serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from kpool_pd.connector import (
    Credential,
    DecodeConnector,
    LandedRequest,
    PrefillGrant,
    PrefillPeer,
    RankShare,
    RingRange,
    StatusError,
    Transport,
    status_of,
)
from kpool_pd.decode_worker import dcp_api as api
from kpool_pd.decode_worker.daemon import OPTIONS as DECODE_OPTIONS
from kpool_pd.decode_worker.capacity import rank_cache_blocks
from kpool_pd.decode_worker.dcp_options import RANK0_DIED, dcp_config
from kpool_pd.decode_worker.router import DNS_PREFIX, parse_targets
from kpool_pd.kvcache import BlockLayout, CacheAllocation, CacheExhaustedError, NodeCache
from kpool_pd.model import DecodeSequence
from kpool_pd.model.dcp_engine import DcpEngine
from kpool_pd.model.dcp_group import DcpGroup
from kpool_pd.runtime import DaemonSpec, NodeContext, Option, Role, model_config, nonnegative_int, run_daemon, text_value

logger = logging.getLogger(__name__)
FILE_SCHEME = "file://"

RANK_OPTIONS: tuple[Option, ...] = (
    Option("dcp-rank", nonnegative_int, 0, "this process's DCP rank (set by rank 0, which starts it)"),
    Option("dcp-rendezvous", text_value, "", "the DCP group's torch.distributed rendezvous (set by rank 0)"),
)


def rendezvous_folder(rendezvous: str) -> Path | None:
    """The folder of a ``file://`` rendezvous (rank 0's private folder), or None for another kind."""
    return Path(rendezvous.removeprefix(FILE_SCHEME)).parent if rendezvous.startswith(FILE_SCHEME) else None


class _Held:
    """One request on this rank: its allocation (taken when its Land arrived), its landing (a task
    until landed) and its sequence."""

    __slots__ = ("allocation", "landing", "landed", "seq")

    def __init__(self, allocation: CacheAllocation) -> None:
        self.allocation = allocation
        self.landing: asyncio.Task | None = None
        self.landed: LandedRequest | None = None
        self.seq: DecodeSequence | None = None

    def free(self) -> None:
        """Release the allocation; a landing still running is cancelled first, and the allocation released
        once it ended (its receives into the blocks retired)."""
        if self.landing is not None and not self.landing.done():
            self.landing.cancel()
            self.landing.add_done_callback(lambda _: self.allocation.release())
            return
        self.allocation.release()


class DcpRankNode(api.DcpRankServiceServicer):
    """Rank ``dcp-rank`` of a DCP decode instance (a runtime ``Node`` and the service's servicer)."""

    service_name = api.SERVICE_NAME
    credential = Credential.CLIENT  # rank 0 is the one client: it presents the instance's secret, not the peer token

    def __init__(self, context: NodeContext) -> None:
        settings = context.settings
        self.config = model_config(settings)
        self.dcp = dcp_config(settings)
        self.shard = self.dcp.shard(settings["dcp_rank"])
        self.share = RankShare(self.shard)  # what each of its pulls lands: its own share of a request
        layout = BlockLayout(self.config.cache)
        self.cache = NodeCache(layout, num_blocks=rank_cache_blocks(settings), num_rings=settings["max_running"],
                               device=context.device)
        self.group = DcpGroup.join(self.shard, init_method=settings["dcp_rendezvous"], device=context.device,
                                   timeout_s=settings["dcp_timeout_s"])
        self.engine = DcpEngine(self.config, self.cache.pool, self.group)
        self.connector = DecodeConnector(self.cache.pool, engine_id=context.engine_id,
                                         config=context.connector_config, registry=context.registry,
                                         transports=context.transports.offered, model_identity=self.config.identity())
        self.servicer = self
        self._peers: dict[str, asyncio.Future] = {}  # address -> its Handshake, then the PrefillPeer
        self._early = tuple(t for t in parse_targets(settings["prefill"]) if not t.startswith(DNS_PREFIX))
        self._connecting: asyncio.Task | None = None
        self._held: dict[str, _Held] = {}
        self.broken = ""
        self.steps, self.step_seconds, self.transfer_bytes = 0, 0.0, 0
        self._rank0 = os.getppid()  # the daemon that started this rank, which owns the rendezvous folder
        self._rendezvous_dir = rendezvous_folder(settings["dcp_rendezvous"])
        self._orphaned = False  # rank 0 died: nobody else removes the rendezvous folder
        signal.signal(RANK0_DIED, self._on_rank0_death)

    @property
    def failure(self) -> str:
        """Why this rank can no longer step (empty: it can); the process then exits with status 1."""
        return self.broken

    # node -----------------------------------------------------------------------------------
    def add_to_server(self, server: grpc.aio.Server) -> None:
        api.add_DcpRankServiceServicer_to_server(self, server)

    def warm_up(self) -> None:
        """Nothing: a DCP rank runs no prefill, and a decode step needs every rank."""

    async def start(self) -> None:
        await self.connector.start()
        self._connecting = asyncio.create_task(self._connect_early(self._early), name="dcp-rank-connect")

    def drain(self) -> None:
        pass

    @property
    def idle(self) -> bool:
        return not self._held

    def leftover(self) -> str | None:
        return f"{len(self._held)} requests held; freeing them" if self._held else None

    async def close(self) -> None:
        if (self._orphaned or os.getppid() != self._rank0) and self._rendezvous_dir is not None:
            # rank 0 died: nobody else removes it; first, before anything below can wait on the group
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
        self._free_all()
        if self._connecting is not None:
            self._connecting.cancel()
            await asyncio.gather(self._connecting, return_exceptions=True)
        await self.connector.close()
        if not self.broken:  # a failed group is not torn down: its peers are gone, and the process exits
            self.group.leave()

    def _on_rank0_death(self, _signum, _frame) -> None:
        """Rank 0 died (the kernel's parent-death signal): stop as on SIGTERM, and clean up after it.
        (While rank 0's threads exit, ``getppid`` may still name it, so the signal itself says so.)"""
        self._orphaned = True
        logger.warning("DCP rank %d: rank 0 (pid %d) died; stopping", self.shard.rank, self._rank0)
        os.kill(os.getpid(), signal.SIGTERM)

    def describe(self) -> dict[str, object]:
        return {"dcp_rank": self.shard.rank, "dcp": self.shard.size, "dcp_interleave": self.shard.interleave,
                "model": self.config.describe()}

    def _free_all(self) -> None:
        for held in self._held.values():
            held.free()
        self._held.clear()

    def _break(self, why: str) -> None:
        if not self.broken:
            logger.error("DCP rank %d can no longer step: %s; freeing %d requests", self.shard.rank, why,
                         len(self._held))
            self.broken = why
        self._free_all()

    async def _check(self, context) -> None:
        if self.broken:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"DCP rank {self.shard.rank} is broken: {self.broken}")

    # RPCs -----------------------------------------------------------------------------------
    async def _peer(self, address: str) -> PrefillPeer:
        """The handshaken prefill node at ``address``; one Handshake at a time per address (a Land and
        the start-up's connect share it), again once the peer was closed."""
        task = self._peers.get(address)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None or task.result().closed)):
            task = self._peers[address] = asyncio.ensure_future(self.connector.connect(address))
        return await asyncio.shield(task)

    async def _connect_early(self, addresses: Sequence[str]) -> None:
        """Handshake with the prefill nodes named by address before the first Land needs them (a
        failure is left to the Land that needs the node)."""
        for address in addresses:
            try:
                await self._peer(address)
            except StatusError as exc:
                logger.info("DCP rank %d: prefill node %s not reachable yet (%s)", self.shard.rank, address, exc)

    async def _land(self, request: api.LandRequest, allocation: CacheAllocation) -> LandedRequest:
        peer = await self._peer(request.prefill_address)
        grant = PrefillGrant(grant_id=request.grant_id, request_id=request.request_id, prompt_len=request.prompt_len,
                             num_blocks=len(request.src_block_ids), first_token=request.first_token,
                             ring_live=RingRange(request.ring_start_slot, request.ring_num_slots),
                             lease_s=request.lease_ms / 1000, src_block_ids=tuple(request.src_block_ids),
                             src_ring_id=request.src_ring_id)
        try:
            return await peer.pull(grant, into=allocation, integrity=request.integrity, share=self.share,
                                   transport=Transport(request.transport) if request.transport else None)
        except StatusError as exc:
            if exc.code is grpc.StatusCode.UNAVAILABLE:
                await self.connector.disconnect(peer)
            raise

    async def Land(self, request: api.LandRequest, context) -> api.LandResponse:
        await self._check(context)
        if request.request_id in self._held:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request.request_id!r} is held already")
        need = self.dcp.rank_blocks_for_request(self.config.cache, request.prompt_len, request.max_tokens)
        try:
            allocation = self.cache.allocate(request.request_id, need)
        except CacheExhaustedError as exc:
            status = status_of(exc, f"DCP rank {self.shard.rank}")
            await context.abort(status.code, status.message)
        held = self._held[request.request_id] = _Held(allocation)
        held.landing = asyncio.ensure_future(self._land(request, allocation))
        try:
            landed = await held.landing  # cancelling this call cancels the pull too
        except asyncio.CancelledError:
            if self._held.get(request.request_id) is held:
                self._held.pop(request.request_id).free()
            if asyncio.current_task().cancelling():
                raise
            await context.abort(grpc.StatusCode.CANCELLED, f"request {request.request_id!r} was dropped")
        except StatusError as exc:
            if self._held.get(request.request_id) is held:
                self._held.pop(request.request_id).free()
            await context.abort(exc.code, f"DCP rank {self.shard.rank}: {exc.message}")
        held.landing, held.landed = None, landed
        if self._held.get(request.request_id) is not held:  # dropped while its pull finished
            held.free()
            await context.abort(grpc.StatusCode.CANCELLED, f"request {request.request_id!r} was dropped")
        held.seq = DecodeSequence(request_id=request.request_id, prompt_len=request.prompt_len,
                                  max_tokens=request.max_tokens, allocation=allocation, output=[request.first_token])
        self.transfer_bytes += landed.nbytes
        return api.LandResponse(transfer_bytes=landed.nbytes, transfer_regions=landed.regions,
                                transfer_ms=landed.seconds * 1000, transport=landed.transport.value)

    def _sequences(self, request_ids: Sequence[str]) -> list[DecodeSequence]:
        missing = [r for r in request_ids if r not in self._held or self._held[r].seq is None]
        if missing:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"DCP rank {self.shard.rank} holds no landed request {missing[:3]}")
        return [self._held[r].seq for r in request_ids]

    def _step(self, seqs: list[DecodeSequence]) -> list[DecodeSequence]:
        """Worker thread: one step of the batch (with every other rank), then the digest of each
        finished sequence, in batch order (rank 0 gathers them)."""
        self.engine.decode_step(seqs)
        done = [s for s in seqs if s.finished]
        for seq in done:
            self.engine.state_digest(seq.block_ids, seq.ring_id, seq.cached)
        return done

    async def _collective(self, context, work, *args):
        try:
            return await asyncio.to_thread(work, *args)
        except Exception as exc:  # a rank left the group, or a collective timed out
            self._break(f"{type(exc).__name__}: {exc}")
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"DCP rank {self.shard.rank}: {self.broken}")

    async def Step(self, request: api.StepRequest, context) -> api.StepResponse:
        await self._check(context)
        try:
            seqs = self._sequences(request.request_ids)
        except StatusError as exc:
            self._break(exc.message)  # out of step with rank 0: the others wait in a collective we skip
            await context.abort(exc.code, exc.message)
        started = time.perf_counter()
        done = await self._collective(context, self._step, seqs)
        self.steps += 1
        self.step_seconds += time.perf_counter() - started
        for seq in done:
            self._held.pop(seq.request_id).free()
        return api.StepResponse()

    async def Drop(self, request: api.DropRequest, context) -> api.DropResponse:
        if not request.request_id:
            dropped = bool(self._held)
            self._free_all()
            return api.DropResponse(dropped=dropped)
        held = self._held.pop(request.request_id, None)
        if held is not None:
            held.free()
        return api.DropResponse(dropped=held is not None)

    async def Status(self, request: api.StatusRequest, context) -> api.StatusResponse:
        return api.StatusResponse(rank=self.shard.rank, free_blocks=self.cache.free_blocks,
                                  num_blocks=self.cache.num_blocks, free_rings=self.cache.free_rings,
                                  num_rings=self.cache.num_rings, requests=len(self._held), steps=self.steps,
                                  step_seconds=self.step_seconds, transfer_bytes=self.transfer_bytes,
                                  broken=self.broken)


SPEC = DaemonSpec(role=Role.DECODE, description=__doc__.splitlines()[0], options=(*DECODE_OPTIONS, *RANK_OPTIONS),
                  build=DcpRankNode, loopback_only=True)


def main(argv: Sequence[str] | None = None) -> int:
    return run_daemon(SPEC, argv)


if __name__ == "__main__":
    raise SystemExit(main())
