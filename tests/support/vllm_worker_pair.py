"""A producer and a consumer worker of ``kpool_pd.vllm`` in this process, over vLLM's own GLM-5-Next cache
specs (no engine), the consumer pulling over the gRPC stream (or UCX); not started. Import it after the test has
checked that vLLM is installed."""

from __future__ import annotations

import contextlib
import secrets
import threading
import time

import grpc

from kpool_pd.vllm.consumer_worker import ConsumerWorker
from kpool_pd.vllm.metadata import KpoolPdMetadata
from kpool_pd.vllm.producer_worker import ProducerWorker
from kpool_pd.vllm.settings import KpoolPdSettings
from tests.support.deadlines import patient
from tests.support.ports import free_port
from tests.support.vllm_spec_procs import pool_of


def worker_pair(lease_s: float, name: str, *, release_after_pull: bool = True, transport: str = "grpc",
                announce: str = "computed") -> tuple[ProducerWorker, list, ConsumerWorker, list]:
    """(producer, its caches, consumer, its caches); engine ids ``{name}-producer`` and ``{name}-consumer``;
    ``release_after_pull`` and ``announce``: the producer's settings (False: its grants end by Release or lease
    only; when it announces grants to a consumer named in advance); ``transport``: the consumer's ("grpc" or
    "ucx")."""
    token = secrets.token_hex(16)
    port = free_port()
    _, producer_caches, producer_pool = pool_of("glm5next", seed=1)
    _, consumer_caches, consumer_pool = pool_of("glm5next", seed=2)
    producer = ProducerWorker(KpoolPdSettings.from_extra_config(
        {"listen": f"127.0.0.1:{port}", "peer_token": token, "lease_s": lease_s,
         "release_after_pull": release_after_pull, "announce": announce}, producer=True),
        producer_pool, engine_id=f"{name}-producer", model_identity="glm5next")
    consumer = ConsumerWorker(KpoolPdSettings.from_extra_config(
        {"peer_token": token, "transport": transport, "producers": [f"127.0.0.1:{port}"]}, producer=False),
        consumer_pool, engine_id=f"{name}-consumer", model_identity="glm5next")
    return producer, producer_caches, consumer, consumer_caches


@contextlib.contextmanager
def started(*workers):
    """Start ``workers`` in turn; on leaving (or a start failing), close those that started, last first."""
    running = []
    try:
        for worker in workers:
            worker.start()
            running.append(worker)
        yield
    finally:
        for worker in reversed(running):
            worker.close()


def wait_finished(consumer: ConsumerWorker, request_id: str, within_s: float) -> tuple[set[str], set[str]]:
    """(the requests whose pulls ended, those that failed) once ``request_id``'s ended, or ``within_s`` passed;
    idle steps wait on the consumer's progress as vLLM's do."""
    done, failed = set(), set()
    deadline = time.monotonic() + patient(within_s)
    while request_id not in done and time.monotonic() < deadline:
        consumer.progress.wait_if_idle(KpoolPdMetadata(idle=True))
        finished, lost = consumer.finished_recving()
        done, failed = done | finished, failed | lost
    return done, failed


class HeldReleases:
    """The producer's Release answers UNAVAILABLE until ``let_through`` (counting the tries)."""

    def __init__(self, producer: ProducerWorker) -> None:
        self.tries = 0
        self._open = threading.Event()
        original = producer.node.Release

        async def release(request, context):
            self.tries += 1
            if not self._open.is_set():
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the test holds Releases back")
            return await original(request, context)
        producer.node.Release = release  # before the server starts: it serves this one

    def let_through(self) -> None:
        self._open.set()


def wait_freed(producer: ProducerWorker, deadline_s: float) -> float:
    """Seconds until the producer holds no allocation (at most ``deadline_s``)."""
    started = time.monotonic()
    while producer.cache.allocations_held and time.monotonic() - started < deadline_s:
        time.sleep(0.02)
    return time.monotonic() - started


def offer_held(producer: ProducerWorker, metadata: KpoolPdMetadata) -> None:
    """``producer.offer(metadata)``, then one turn of the producer's loop: ``offer`` queues the lending on the loop
    and returns, so a test that looks at the held grants from this thread waits for that turn first."""

    async def turn() -> None:
        return None

    producer.offer(metadata)
    producer.loop.call(turn)
