"""The decode scheduler against a real prefill connector on loopback, both with the synthetic model:
admission allocates a request's every block and its ring as one allocation of the scheduler's, the
pull lands the prompt into it (the connector allocates nothing), its events are typed (Tokens, then Finished) and match the colocated run byte for byte, and every
exit (done, failed pull, cancelled while decoding, failed step) frees what it holds exactly once."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kpool_pd.connector import ConnectorConfig, DecodeConnector, PrefillConnector, StatusError, Transport
from kpool_pd.connector.shared import regions  # fault injection: how the gRPC stream reads a region's bytes
from kpool_pd.decode_worker.fetch import OneNode, PullChoice
from kpool_pd.decode_worker.jobs import Failed, Finished, JobState, Tokens
from kpool_pd.decode_worker.router import PrefillRouter
from kpool_pd.decode_worker.scheduler import DecodeScheduler
from kpool_pd.kvcache import NodeCache
from kpool_pd.model import Engine, ModelConfig
from kpool_pd.model.colocated import GenerateRequest, run_colocated
from kpool_pd.prefill_worker.batcher import BatchingPrefillEngine
from tests.support.deadlines import patient
from tests.support.serving import serve_prefill, stop_prefill

CONFIG = ModelConfig.build(num_spec=3, num_layers=2, seed=5, block_size=64)  # a request spans several blocks
GRPC = Transport.GRPC_STREAM
NUM_BLOCKS, NUM_RINGS = 16, 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, patient(120)))


class Nodes:
    """A prefill node (connector + batching engine) and a decode node (connector, router,
    scheduler and its loop) in this event loop, each with its own pool."""

    def __init__(self, transfer_timeout_s: float = 10.0, queue_timeout_s: float = 10.0, push: bool = True) -> None:
        self.queue_timeout_s = queue_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.push = push  # False: Prefill, then Pull (what a node without PrefillPush gets)

    async def __aenter__(self) -> "Nodes":
        config = ConnectorConfig(rpc_timeout_s=10.0, transfer_timeout_s=self.transfer_timeout_s)
        self.p_cache = NodeCache(CONFIG.cache, num_blocks=NUM_BLOCKS, num_rings=NUM_RINGS)
        self.batcher = BatchingPrefillEngine(Engine(CONFIG, self.p_cache.pool), self.p_cache, max_batch_tokens=4096,
                                             max_queue=8, registry=CollectorRegistry())
        self.prefill = PrefillConnector(self.p_cache.pool, self.batcher, engine_id="prefill-s",
                                        config=config, registry=CollectorRegistry(), transports=(GRPC,))
        self.batch_loop = asyncio.create_task(self.batcher.run())
        self.server = await serve_prefill(self.prefill)
        self.d_cache = NodeCache(CONFIG.cache, num_blocks=NUM_BLOCKS, num_rings=NUM_RINGS)
        self.decode = await DecodeConnector(self.d_cache.pool, engine_id="decode-s", config=config,
                                            registry=CollectorRegistry(), transports=(GRPC,)).start()
        self.router = PrefillRouter(self.decode, (f"127.0.0.1:{self.server.port}",), health_interval_s=60,
                                    rpc_timeout_s=patient(10))
        await self.router.start()
        self.registry = CollectorRegistry()
        self.engine = Engine(CONFIG, self.d_cache.pool)
        fetch = OneNode(CONFIG.cache, PullChoice(transport=GRPC, integrity=True, rpc_timeout_s=config.rpc_timeout_s),
                        pipelined=True, push=self.push)
        self.scheduler = DecodeScheduler(self.engine, self.d_cache, self.decode, self.router, fetch=fetch,
                                         max_running=4, max_queue=8,
                                         queue_timeout_s=self.queue_timeout_s, registry=self.registry)
        self.decode_loop = asyncio.create_task(self.scheduler.run())
        return self

    async def __aexit__(self, *exc) -> None:
        for task in (self.decode_loop, self.batch_loop):
            task.cancel()
        await asyncio.gather(self.decode_loop, self.batch_loop, return_exceptions=True)
        self.scheduler.close()
        await self.router.close()
        await self.decode.close()
        await stop_prefill(self.server, self.prefill)

    def free(self) -> tuple[int, int, int, int]:
        return self.p_cache.free_blocks, self.p_cache.free_rings, self.d_cache.free_blocks, self.d_cache.free_rings

    def sample(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(f"kpoolpd_decode_{name}", labels) or 0.0

    async def fetched(self, request_id: str, prompt: tuple[int, ...], max_tokens: int):
        job = self.scheduler.submit(request_id, prompt, max_tokens)
        await self.scheduler.wait_admitted(job)
        await self.scheduler.fetch(job)
        return job

    async def until_free(self, start) -> bool:
        for _ in range(500):
            if self.free() == start and self.scheduler.idle:
                return True
            await asyncio.sleep(0.01)
        return False


PROMPT = tuple((7 * i + 3) % CONFIG.vocab_size for i in range(90))


def test_a_request_is_one_allocation_of_the_scheduler_landed_in_by_the_pull_and_matches_colocated():
    async def main():
        async with Nodes() as nodes:
            start = nodes.free()
            job = await nodes.fetched("one", PROMPT, 60)
            landed, allocation = job.landed, job.allocation
            assert job.need_blocks == CONFIG.cache.blocks_for_request(len(PROMPT), 60) > landed.grant.num_blocks == landed.prompt_blocks
            assert allocation.num_blocks == job.need_blocks and job.seq.allocation is allocation
            assert nodes.free() == (start[0], start[1], start[2] - job.need_blocks, start[3] - 1)
            assert nodes.sample("reserved_blocks") == job.need_blocks
            nodes.scheduler.first_token_sent(job)
            nodes.scheduler.start_decoding(job)
            tokens, events = list(job.seq.output[:1]), []
            while not events or not isinstance(events[-1], Finished):
                events.append(await asyncio.wait_for(job.events.get(), 30))
                if isinstance(events[-1], Tokens):
                    tokens += events[-1].token_ids
            assert all(isinstance(e, Tokens) and e.token_ids for e in events[:-1])
            nodes.scheduler.abandon(job, "ok")  # what the handler does on its way out: nothing more to free
            assert await nodes.until_free(start), nodes.free()
            assert job.state is JobState.DONE and allocation.released
            reference, = run_colocated(CONFIG, [GenerateRequest(request_id="one", prompt=PROMPT, max_tokens=60)])
            finished = events[-1]
            assert tuple(tokens) == reference.tokens and finished.num_tokens == len(reference.tokens)
            assert (finished.output_digest, finished.state_digest) == (reference.output_digest, reference.state_digest)
            assert nodes.sample("requests_total", outcome="ok") == 1 and nodes.sample("reserved_blocks") == 0
    run(main())


def test_steps_and_digests_do_not_wait_for_the_event_loops_default_executor():
    """Every thread of the loop's default executor busy (other work of the process): the request is still
    stepped to its end and digested."""
    async def main():
        async with Nodes() as nodes:
            job = await nodes.fetched("busy", PROMPT, 12)
            release = threading.Event()
            loop = asyncio.get_running_loop()
            busy = [loop.run_in_executor(None, release.wait, 120) for _ in range(64)]  # more than its threads
            try:
                nodes.scheduler.first_token_sent(job)
                nodes.scheduler.start_decoding(job)
                events = [await asyncio.wait_for(job.events.get(), 30)]
                while not isinstance(events[-1], Finished):
                    events.append(await asyncio.wait_for(job.events.get(), 30))
                assert not any(f.done() for f in busy)  # the default executor was busy all along
                assert events[-1].num_tokens == 12 and events[-1].state_digest
            finally:
                release.set()
                await asyncio.gather(*busy)
            nodes.scheduler.abandon(job, "ok")
    run(main())


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_a_failed_pull_leaves_the_allocation_to_the_scheduler_which_releases_it_once(monkeypatch, push):
    real = regions.host_bytes

    def flip_one_byte(view):
        data = bytearray(real(view))
        data[len(data) // 3] ^= 0x10
        return bytes(data)
    monkeypatch.setattr(regions, "host_bytes", flip_one_byte)

    async def main():
        async with Nodes(push=push) as nodes:
            start = nodes.free()
            job = nodes.scheduler.submit("corrupt", PROMPT, 40)
            await nodes.scheduler.wait_admitted(job)
            with pytest.raises(StatusError) as err:
                await nodes.scheduler.fetch(job)
            assert err.value.code is grpc.StatusCode.DATA_LOSS
            assert ("push of corrupt to" if push else "transfer from") in err.value.message
            # the pull released nothing of ours (the allocation is the scheduler's until the handler leaves);
            # the prefill node's grant is released
            assert job.landed is None and not job.allocation.released
            assert nodes.free() == (start[0], start[1], start[2] - job.need_blocks, start[3] - 1)
            assert nodes.sample("reserved_blocks") == job.need_blocks
            nodes.scheduler.abandon(job, "failed")
            nodes.scheduler.abandon(job, "failed")  # idempotent
            assert nodes.sample("reserved_blocks") == 0 and nodes.sample("requests_total", outcome="failed") == 1
            assert nodes.scheduler.idle and nodes.free() == start
    run(main())


def test_a_request_cancelled_while_decoding_is_freed_once_by_the_loop():
    async def main():
        async with Nodes() as nodes:
            start = nodes.free()
            job = await nodes.fetched("leaver", PROMPT, 200)
            nodes.scheduler.start_decoding(job)
            assert isinstance(await asyncio.wait_for(job.events.get(), 30), Tokens)
            nodes.scheduler.abandon(job, "cancelled")  # the client went away mid-stream
            assert job.cancelled and job.state is JobState.DECODING  # the loop frees it, between steps
            assert await nodes.until_free(start), nodes.free()
            nodes.scheduler.finish(job, "cancelled")  # a second exit frees nothing twice
            assert nodes.free() == start and job.allocation.released
            assert nodes.sample("requests_total", outcome="cancelled") == 1 and nodes.sample("reserved_blocks") == 0
    run(main())


def test_a_failed_step_reports_failed_and_frees(monkeypatch):
    async def main():
        async with Nodes() as nodes:
            start = nodes.free()
            job = await nodes.fetched("stepper", PROMPT, 30)

            def broken_step(_sequences):
                raise RuntimeError("injected step failure")
            monkeypatch.setattr(nodes.engine, "decode_step", broken_step)
            nodes.scheduler.start_decoding(job)
            event = await asyncio.wait_for(job.events.get(), 30)
            assert isinstance(event, Failed) and event.error.code is grpc.StatusCode.INTERNAL
            assert await nodes.until_free(start), nodes.free()
            assert nodes.sample("requests_total", outcome="error") == 1
            nodes.scheduler.abandon(job, "failed")  # the handler leaves after raising the error
            assert nodes.free() == start and nodes.sample("requests_total", outcome="failed") == 0
    run(main())


def test_a_pull_that_times_out_takes_the_node_out_until_the_engine_handshook_again():
    """A pull that ends DEADLINE_EXCEEDED: the node's grant is released, the router has no usable node (the
    decode node's health follows it: NOT_SERVING) until the engine handshook again, presenting its engine
    secret, and the next request lands from that node."""
    async def main():
        async with Nodes(transfer_timeout_s=1.0, push=False) as nodes:
            start = nodes.free()
            real = nodes.prefill.pull_messages
            changes = []
            nodes.router.on_change = changes.append

            async def stalled(request):
                await asyncio.sleep(3600)
                yield  # never reached
            nodes.prefill.pull_messages = stalled
            job = nodes.scheduler.submit("stuck", PROMPT, 8)
            await nodes.scheduler.wait_admitted(job)
            with pytest.raises(StatusError) as err:
                await nodes.scheduler.fetch(job)
            assert err.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
            assert changes[:1] == [False]  # no usable prefill node: the decode node's health says NOT_SERVING
            nodes.scheduler.abandon(job, "failed")
            nodes.prefill.pull_messages = real
            for _ in range(1000):
                if nodes.router.usable:
                    break
                await asyncio.sleep(0.01)
            assert nodes.router.usable and changes[-1] is True, nodes.router.reasons()
            job = await nodes.fetched("after", PROMPT, 8)
            assert job.landed.grant.num_blocks > 0
            nodes.scheduler.abandon(job, "failed")
            assert await nodes.until_free(start), nodes.free()
    run(main())


@pytest.mark.parametrize("queue_timeout_s", [0.0, 0.3], ids=["no-bound", "bound-0.3s"])
def test_a_request_that_fits_waits_for_room_and_only_a_bound_it_was_given_ends_the_wait(queue_timeout_s):
    """max_running 4 admitted: a fifth request waits. Without a bound (0) it waits until a slot frees,
    then it is admitted; with one it fails DEADLINE_EXCEEDED naming it. Never RESOURCE_EXHAUSTED: that is
    the full queue's answer (submit)."""
    async def main():
        async with Nodes(queue_timeout_s=queue_timeout_s) as nodes:
            start = nodes.free()
            running = [nodes.scheduler.submit(f"r{i}", PROMPT, 4) for i in range(4)]
            for job in running:
                await nodes.scheduler.wait_admitted(job)
            waiting = nodes.scheduler.submit("fifth", PROMPT, 4)
            admitted = asyncio.ensure_future(nodes.scheduler.wait_admitted(waiting))
            if queue_timeout_s:
                with pytest.raises(StatusError) as failed:
                    await asyncio.wait_for(admitted, 30)
                assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
                assert "within 0.3 s (--queue-timeout-s)" in failed.value.message
            else:
                done, _ = await asyncio.wait({admitted}, timeout=1.0)  # well past the other case's bound
                assert not done and waiting.state is JobState.WAITING
                nodes.scheduler.abandon(running.pop(), "cancelled")  # a slot frees
                await asyncio.wait_for(admitted, 30)
                assert waiting.state is JobState.PREFILLING
                running.append(waiting)
            for job in running:
                nodes.scheduler.abandon(job, "cancelled")
            if queue_timeout_s:
                nodes.scheduler.abandon(waiting, "failed")
            assert await nodes.until_free(start), nodes.free()
    run(main())
