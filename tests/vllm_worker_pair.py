"""A producer and a consumer worker of ``kpool_pd.vllm`` in this process, over vLLM's own GLM-5-Next cache
specs (no engine), the consumer pulling over the gRPC stream; not started. Import it after the test has
checked that vLLM is installed."""

from __future__ import annotations

import secrets
import time

from kpool_pd.vllm.consumer_worker import ConsumerWorker
from kpool_pd.vllm.metadata import KpoolPdMetadata
from kpool_pd.vllm.producer_worker import ProducerWorker
from kpool_pd.vllm.settings import KpoolPdSettings
from tests.ports import free_port
from tests.vllm_spec_procs import pool_of


def worker_pair(lease_s: float, name: str) -> tuple[ProducerWorker, list, ConsumerWorker, list]:
    """(producer, its caches, consumer, its caches); engine ids ``{name}-producer`` and ``{name}-consumer``."""
    token = secrets.token_hex(16)
    port = free_port()
    _, producer_caches, producer_pool = pool_of("glm5next", seed=1)
    _, consumer_caches, consumer_pool = pool_of("glm5next", seed=2)
    producer = ProducerWorker(KpoolPdSettings.from_extra_config(
        {"listen": f"127.0.0.1:{port}", "peer_token": token, "lease_s": lease_s}, producer=True),
        producer_pool, engine_id=f"{name}-producer", model_identity="glm5next")
    consumer = ConsumerWorker(KpoolPdSettings.from_extra_config(
        {"peer_token": token, "transport": "grpc", "producers": [f"127.0.0.1:{port}"]}, producer=False),
        consumer_pool, engine_id=f"{name}-consumer", model_identity="glm5next")
    return producer, producer_caches, consumer, consumer_caches


def wait_finished(consumer: ConsumerWorker, request_id: str, within_s: float) -> tuple[set[str], set[str]]:
    """(the requests whose pulls ended, those that failed) once ``request_id``'s ended, or ``within_s`` passed;
    idle steps wait on the consumer's progress as vLLM's do."""
    done, failed = set(), set()
    deadline = time.monotonic() + within_s
    while request_id not in done and time.monotonic() < deadline:
        consumer.progress.wait_if_idle(KpoolPdMetadata(idle=True))
        finished, lost = consumer.finished_recving()
        done, failed = done | finished, failed | lost
    return done, failed
