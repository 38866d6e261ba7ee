"""What both worker sides share (``kpool_pd.vllm.producer_worker``, ``kpool_pd.vllm.consumer_worker``): the
connector's event loop in a thread of its own, how vLLM's idle steps learn that a transfer ended, the
connector's config from the settings, a rank's address and the PackedPull staging buffers made at start.

**Idle steps.** While requests wait on transfers and nothing else runs, vLLM steps without pause; a step
that schedules no token waits in ``get_finished`` (``TransferProgress.wait_if_idle``) with the GIL released,
so that the connector's thread runs. A consumer's idle step waits for every pull in flight: until none is
left, as long as one ended within ``IDLE_WAIT_S``, and at most ``IDLE_BATCH_S``, so that the requests whose
pulls began together join the batch in one step (and the engine computes no partial batches meanwhile).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

from kpool_pd.connector import ConnectorConfig, StagingBuffers
from kpool_pd.kvcache import PlanarPool
from kpool_pd.transfer_params import split_host_port
from kpool_pd.vllm.metadata import KpoolPdMetadata
from kpool_pd.vllm.ranks import RankSeat
from kpool_pd.vllm.settings import KpoolPdSettings

CALL_TIMEOUT_S = 30.0  # a hand-over to the loop (start, an offer) that takes longer is a failure
IDLE_WAIT_S = 0.02  # the longest an idle step waits for the next transfer to end (a new request waits as long)
IDLE_BATCH_S = 0.1  # the longest an idle step waits for every pull in flight (transfers still ending)
STAGING_WARM_BYTES = 64 << 20  # the most a staging buffer made at start holds (a larger batch makes its own): the
# bench's 64 requests of mixed lengths came to one batch of 34.2 MiB in whole blocks
STAGING_WARM_BUFFERS = 2  # made at start: a step's batch and the next step's, in flight at once


class TransferProgress:
    """The connector's thread tells vLLM's idle steps that a transfer ended; ``begin``/``end`` count the
    transfers in flight that an idle step waits for (a consumer's pulls)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0

    def begin(self, count: int = 1) -> None:
        with self._lock:
            self._in_flight += count

    def end(self) -> None:
        with self._lock:
            self._in_flight -= 1
        self._event.set()

    def note(self) -> None:
        self._event.set()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def wait_if_idle(self, metadata: KpoolPdMetadata) -> None:
        """An idle step (``metadata.idle``) waits for a transfer's end, up to ``IDLE_WAIT_S``. While transfers
        counted by ``begin`` are in flight it waits for them all: up to ``IDLE_BATCH_S`` for the first to end,
        then as long as the next ends within ``IDLE_WAIT_S``, never past ``IDLE_BATCH_S``."""
        if not metadata.idle:
            self._event.clear()
            return
        deadline = time.monotonic() + (IDLE_BATCH_S if self.in_flight > 0 else IDLE_WAIT_S)
        ended_before = False
        while True:
            left = deadline - time.monotonic()
            wait_s = min(left, IDLE_WAIT_S) if ended_before else left
            ended = wait_s > 0 and self._event.wait(wait_s)
            self._event.clear()
            if not ended or self.in_flight <= 0:
                return
            ended_before = True


class ConnectorLoop:
    """An asyncio loop in a daemon thread; ``call`` runs a coroutine there and waits for its result, ``post`` queues
    a plain callback without waiting."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, make: Callable[[], Awaitable], timeout_s: float = CALL_TIMEOUT_S):
        async def run():
            return await make()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout_s)

    def post(self, callback: Callable[..., None], *args) -> None:
        """Queue ``callback(*args)`` on the loop and return: it runs after everything queued before it and before
        everything that reaches the loop later (the loop runs its callbacks in order)."""
        self.loop.call_soon_threadsafe(callback, *args)

    def submit(self, make: Callable[[], Awaitable]) -> None:
        async def run():
            await make()
        asyncio.run_coroutine_threadsafe(run(), self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CALL_TIMEOUT_S)


def connector_config(settings: KpoolPdSettings) -> ConnectorConfig:
    return ConnectorConfig(peer_token=settings.peer_token, lease_s=settings.lease_s,
                           transfer_timeout_s=settings.pull_timeout_s, rpc_timeout_s=settings.rpc_timeout_s,
                           ucx_progress=settings.ucx_progress)


def rank_address(address: str, seat: RankSeat) -> str:
    """``address`` (``"host:port"``, the engine's) with the port of ``seat``'s rank."""
    host, port = split_host_port(address, "the producer's address")
    return f"[{host}]:{seat.port(port)}" if ":" in host else f"{host}:{seat.port(port)}"


def warm_staging(staging: StagingBuffers, pool: PlanarPool) -> int:
    """Make and touch ``STAGING_WARM_BUFFERS`` PackedPull staging buffers now, each the cache's bytes up to
    ``STAGING_WARM_BYTES``, so that no batch pays a fresh buffer's page faults (a profile at 64 requests saw
    the first batches take 340 ms to pack into new buffers). Returns the bytes of each."""
    nbytes = min(sum(plane.numel() for plane in pool.planes), STAGING_WARM_BYTES)
    buffers = [staging.take(nbytes) for _ in range(STAGING_WARM_BUFFERS)]
    for buffer in buffers:
        staging.give(buffer)
    return buffers[0].numel()
