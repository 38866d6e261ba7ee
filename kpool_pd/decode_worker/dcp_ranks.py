"""Rank 0's side of a DCP decode instance: it starts ranks 1..N-1, drives them through their
``DcpRankService``, watches them, and reports every rank's metrics.

The ranks are child processes (``python -m kpool_pd.decode_worker.dcp_rank``) given rank 0's settings
through their environment (secrets included: a command line is readable by every user) plus their
rank, the group's rendezvous, any free port and a ready file; they get SIGTERM when rank 0 dies.
A rank serves its ``DcpRankService`` on loopback only, in plaintext, and requires the instance's
secret, which rank 0 makes for this instance alone and hands its ranks as their client token
(``KPOOLPD_TOKEN``): neither the fleet's peer token nor a process off the host reaches it.
Every call has a deadline. A rank that cannot step any more (its process exited, a collective
failed) breaks the instance for good: ``broken`` says why, and rank 0 fails its requests and
stops serving (the pod's ranks restart together).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import Gauge

from kpool_pd.connector import PrefillGrant, StatusError, Transport, auth_metadata, dial_target, open_channel
from kpool_pd.decode_worker import dcp_api as api
from kpool_pd.decode_worker.dcp_options import RANK0_DIED, rank_device
from kpool_pd.kvcache import DcpConfig
from kpool_pd.runtime import NodeContext, Option
from kpool_pd.runtime.node import LOOPBACK
from kpool_pd.runtime.process import parent_death_env

logger = logging.getLogger(__name__)

RANK_MODULE = "kpool_pd.decode_worker.dcp_rank"
STOP_GRACE_S = 10.0
SECRET_BYTES = 32
# The rank's client token: the only credential its DcpRankService takes (runtime.GrpcServer checks it).
INSTANCE_SECRET_ENV = "KPOOLPD_TOKEN"


def settings_env(options: Sequence[Option], settings: Mapping[str, Any]) -> dict[str, str]:
    """Environment variables that give each option its value in ``settings`` (``KPOOLPD_<NAME>``)."""
    env = {}
    for option in options:
        value = settings[option.key]
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, bool):
            value = "true" if value else "false"
        env[option.env] = str(value)
    return env


class DcpRanks:
    """Ranks 1..N-1 of rank 0's instance. ``await connect()`` once they serve; then the calls."""

    def __init__(self, context: NodeContext, dcp: DcpConfig, options: Sequence[Option], rendezvous_dir: str) -> None:
        settings = context.settings
        self.dcp = dcp
        self.timeout_s = context.connector_config.pull_budget_s(computing=True)  # a rank's Land: one pull
        self.rpc_timeout_s = settings["rpc_timeout_s"]
        self.step_timeout_s = settings["dcp_timeout_s"]
        self.secret = secrets.token_urlsafe(SECRET_BYTES)  # this instance's alone: the ranks' API takes only it
        self.workdir = Path(rendezvous_dir)
        base = settings_env(options, settings)
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, dcp.size):
            env = {**os.environ, **base, "PYTHONUNBUFFERED": "1", INSTANCE_SECRET_ENV: self.secret,
                   "KPOOLPD_DCP_RANK": str(rank), "KPOOLPD_DCP_RENDEZVOUS": self.rendezvous,
                   "KPOOLPD_PORT": "0", "KPOOLPD_METRICS_PORT": "-1", "KPOOLPD_HEALTH_PORT": "-1",
                   "KPOOLPD_READY_FILE": str(self._ready_file(rank)), "KPOOLPD_ENGINE_ID": f"{context.engine_id}/dcp{rank}",
                   "KPOOLPD_DEVICE": rank_device(settings, rank), **parent_death_env(RANK0_DIED)}
            self.procs.append(subprocess.Popen([sys.executable, "-m", RANK_MODULE], env=env))
        self.addresses: list[str] = []
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[api.DcpRankServiceStub] = []
        self.broken = ""
        self._broken_event = asyncio.Event()  # set with ``broken``
        self.on_broken: Callable[[str], None] | None = None
        self._background: set[asyncio.Task] = set()
        labels = ["rank"]
        self.up = Gauge("kpoolpd_decode_dcp_rank_up", "1 while a DCP rank answers and can step", labels,
                        registry=context.registry)
        self.free_blocks = Gauge("kpoolpd_decode_dcp_rank_free_blocks", "Free blocks of each DCP rank", labels,
                                 registry=context.registry)
        self.free_rings = Gauge("kpoolpd_decode_dcp_rank_free_rings", "Free rings of each DCP rank", labels,
                                registry=context.registry)
        self.held = Gauge("kpoolpd_decode_dcp_rank_requests", "Requests held by each DCP rank", labels,
                          registry=context.registry)
        self.steps = Gauge("kpoolpd_decode_dcp_rank_steps", "Decode steps each DCP rank ran", labels,
                           registry=context.registry)
        self.step_seconds = Gauge("kpoolpd_decode_dcp_rank_step_seconds", "Time each DCP rank spent in decode steps",
                                  labels, registry=context.registry)
        self.transfer_bytes = Gauge("kpoolpd_decode_dcp_rank_transfer_bytes", "Bytes each DCP rank pulled", labels,
                                    registry=context.registry)

    @property
    def rendezvous(self) -> str:
        return f"file://{self.workdir / 'rendezvous'}"

    def _ready_file(self, rank: int) -> Path:
        return self.workdir / f"rank-{rank}.ready.json"

    # start and stop ---------------------------------------------------------------------------
    async def connect(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every rank serves; RuntimeError naming a rank that exited
        or did not come up."""
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(self.procs, start=1):
            ready = self._ready_file(rank)
            while not ready.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"DCP rank {rank} exited with status {proc.returncode} before it was ready")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"DCP rank {rank} was not ready within {timeout_s:.0f} s")
                await asyncio.sleep(0.05)
            port = json.loads(ready.read_text())["grpc_port"]
            self.addresses.append(dial_target(LOOPBACK, port))
            channel = open_channel(self.addresses[-1], None, ())  # loopback, plaintext: the secret authenticates
            self._channels.append(channel)
            self._stubs.append(api.DcpRankServiceStub(channel))
        logger.info("DCP ranks 1 to %d serve at %s", self.dcp.size - 1, ", ".join(self.addresses))

    def kill(self) -> None:
        """Stop the ranks at once (SIGKILL) and remove the rendezvous folder: for a start that failed."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(STOP_GRACE_S)
        shutil.rmtree(self.workdir, ignore_errors=True)

    async def close(self) -> None:
        """Stop the ranks (SIGTERM, SIGKILL after a grace), forget them and remove the rendezvous
        folder; idempotent."""
        try:
            for task in list(self._background):
                task.cancel()
            for channel in self._channels:
                await channel.close()
            self._channels.clear()
            for proc in self.procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in self.procs:
                try:
                    await asyncio.to_thread(proc.wait, STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    await asyncio.to_thread(proc.wait, STOP_GRACE_S)
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # failures ----------------------------------------------------------------------------------
    def fail(self, why: str) -> None:
        """The instance can no longer step (idempotent): every later call is UNAVAILABLE."""
        if self.broken:
            return
        self.broken = why
        self._broken_event.set()
        logger.error("DCP instance broken: %s", why)
        for rank in range(1, self.dcp.size):
            self.up.labels(str(rank)).set(0)
        self.drop_soon()  # the ranks still alive free everything they hold
        if self.on_broken is not None:
            self.on_broken(why)

    async def until_broken(self) -> str:
        """Wait until the instance breaks (``fail``); why it did."""
        await self._broken_event.wait()
        return self.broken

    def _check(self) -> None:
        if self.broken:
            raise StatusError(grpc.StatusCode.UNAVAILABLE, f"the DCP decode instance is broken: {self.broken}")

    def _exited(self) -> list[int]:
        return [rank for rank, proc in enumerate(self.procs, start=1) if proc.poll() is not None]

    async def _all(self, call: str, request, timeout_s: float, *, collective: bool) -> list:
        """``call`` on every rank at once. StatusError: a rank's own status, or UNAVAILABLE naming a
        rank that failed; a collective call that fails, or a rank whose process exited, breaks the
        instance."""
        self._check()
        md = auth_metadata(self.secret)
        calls = [getattr(stub, call)(request, timeout=timeout_s, metadata=md) for stub in self._stubs]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [(rank, r) for rank, r in enumerate(results, start=1) if isinstance(r, BaseException)]
        if not errors:
            return results
        rank, exc = errors[0]
        message = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else f"{type(exc).__name__}: {exc}"
        code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.UNAVAILABLE
        exited = self._exited()
        if collective or exited:
            self.fail(f"DCP rank {exited[0] if exited else rank} "
                      f"{'exited' if exited else 'failed'} during {call}: {message}")
            code = grpc.StatusCode.UNAVAILABLE
        raise StatusError(code, f"DCP rank {rank}: {message}")

    # calls -------------------------------------------------------------------------------------
    async def land(self, request_id: str, max_tokens: int, address: str, grant: PrefillGrant,
                   transport: Transport | None, integrity: bool) -> list[api.LandResponse]:
        """Every other rank pulls its share of ``grant`` from the prefill node at ``address``."""
        live = grant.ring_live
        request = api.LandRequest(
            request_id=request_id, prefill_address=address, grant_id=grant.grant_id, prompt_len=grant.prompt_len,
            max_tokens=max_tokens, first_token=grant.first_token, src_block_ids=list(grant.src_block_ids),
            src_ring_id=grant.src_ring_id, ring_start_slot=live.start_slot, ring_num_slots=live.num_slots,
            lease_ms=int(grant.lease_s * 1000), transport=transport.value if transport else 0, integrity=integrity)
        return await self._all("Land", request, self.timeout_s, collective=False)

    async def step(self, request_ids: Sequence[str]) -> None:
        """Every other rank runs the step of this batch (rank 0 runs its own meanwhile)."""
        await self._all("Step", api.StepRequest(request_ids=list(request_ids)), self.step_timeout_s, collective=True)

    def drop_soon(self, request_id: str = "") -> None:
        """Every rank frees ``request_id`` (empty: everything), in the background; best effort (a rank
        that is gone holds nothing)."""
        if not self._stubs:
            return
        task = asyncio.ensure_future(self._drop(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _drop(self, request_id: str) -> None:
        md = auth_metadata(self.secret)
        calls = [stub.Drop(api.DropRequest(request_id=request_id), timeout=self.timeout_s, metadata=md)
                 for stub in self._stubs]
        for rank, result in enumerate(await asyncio.gather(*calls, return_exceptions=True), start=1):
            if isinstance(result, BaseException):
                logger.warning("drop of %r on DCP rank %d failed: %s", request_id or "everything", rank, result)

    async def watch(self, interval_s: float, own: Callable[[], api.StatusResponse]) -> None:
        """Every ``interval_s``: each rank's Status into the per-rank metrics (rank 0's from ``own``);
        a rank whose process exited, or that says it is broken, breaks the instance. A Status that
        gets no answer within the RPC deadline marks its rank down until it answers again."""
        md = auth_metadata(self.secret)
        while True:
            statuses = [own()]
            for rank, stub in enumerate(self._stubs, start=1):
                try:
                    statuses.append(await stub.Status(api.StatusRequest(), timeout=self.rpc_timeout_s, metadata=md))
                except grpc.aio.AioRpcError as exc:
                    logger.warning("DCP rank %d did not answer its Status: %s", rank, exc.code().name)
                    self.up.labels(str(rank)).set(0)
            for status in statuses:
                rank = str(status.rank)
                self.up.labels(rank).set(0 if status.broken or self.broken else 1)
                self.free_blocks.labels(rank).set(status.free_blocks)
                self.free_rings.labels(rank).set(status.free_rings)
                self.held.labels(rank).set(status.requests)
                self.steps.labels(rank).set(status.steps)
                self.step_seconds.labels(rank).set(status.step_seconds)
                self.transfer_bytes.labels(rank).set(status.transfer_bytes)
                if status.broken:
                    self.fail(f"DCP rank {status.rank} is broken: {status.broken}")
            exited = self._exited()
            if exited:
                self.fail(f"DCP rank {exited[0]} exited with status {self.procs[exited[0] - 1].returncode}")
            await asyncio.sleep(interval_s)


def rendezvous_dir() -> str:
    """A fresh private folder for the group's rendezvous and the ranks' ready files."""
    return tempfile.mkdtemp(prefix="kpoolpd-dcp-")
