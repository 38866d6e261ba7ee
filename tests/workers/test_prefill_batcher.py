"""The prefill daemon's token budget: long prompts split across steps, short ones sharing a step, the same
bytes as whole prefills, progress reported after each chunk, and a caller leaving mid-prompt frees all."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from kpool_pd.connector import PrefillInput, PrefillProgress
from kpool_pd.kvcache import CacheFamily, NodeCache
from kpool_pd.model import Engine, ModelConfig, PrefillJob
from kpool_pd.prefill_worker.batcher import BatchingPrefillEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NUM_BLOCKS, NUM_RINGS = 24, 6


class Recording(Engine):
    """The engine, keeping each step's chunks as (prompt length, start, end)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[list[tuple[int, int, int]]] = []

    def prefill(self, jobs):
        self.steps.append([(len(j.prompt), j.start, j.stop) for j in jobs])
        return super().prefill(jobs)


class Node:
    def __init__(self, config: ModelConfig, budget: int) -> None:
        self.cache = NodeCache(config.cache, num_blocks=NUM_BLOCKS, num_rings=NUM_RINGS)
        self.engine = Recording(config, self.cache.pool)
        self.batcher = BatchingPrefillEngine(self.engine, self.cache, max_batch_tokens=budget, max_queue=8,
                                             registry=CollectorRegistry())

    def progress(self, request_id: str) -> PrefillProgress:
        return PrefillProgress(request_id)


def prompts(config: ModelConfig, lengths: list[int]) -> list[tuple[int, ...]]:
    return [tuple((7 * i + 3 * n) % config.vocab_size for i in range(n)) for n in lengths]


async def prefill_all(node: Node, batch: list[tuple[int, ...]]):
    loop = asyncio.create_task(node.batcher.run())
    caches = [node.progress(f"r{i}") for i in range(len(batch))]
    try:
        outs = await asyncio.gather(*(node.batcher.prefill(PrefillInput(request_id=f"r{i}", prompt_token_ids=p), c)
                                      for i, (p, c) in enumerate(zip(batch, caches))))
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    return outs, caches


@pytest.mark.parametrize("family", list(CacheFamily), ids=lambda f: f.value)
def test_steps_keep_the_budget_and_give_the_bytes_of_whole_prefills(family):
    config = ModelConfig.build(family=family, num_layers=2, num_spec=3)
    batch = prompts(config, [150, 5, 3, 70])
    node = Node(config, budget=64)
    outs, caches = asyncio.run(prefill_all(node, batch))
    steps = node.engine.steps
    assert all(sum(end - start for _, start, end in step) <= 64 for step in steps)
    assert steps[0] == [(150, 0, 64)] and steps[1] == [(150, 64, 128)]  # the oldest prompt first, split
    assert steps[2] == [(150, 128, 150), (5, 0, 5), (3, 0, 3), (70, 0, 34)]  # short prompts share the step
    assert steps[3] == [(70, 34, 70)]
    assert all(c.prefilled == len(p) for c, p in zip(caches, batch))
    whole_cache = NodeCache(config.cache, num_blocks=NUM_BLOCKS, num_rings=NUM_RINGS)
    whole = Engine(config, whole_cache.pool)
    skip = whole_cache.allocate("skip", 1, ring=False)  # so the block ids differ between the two runs
    for out, prompt, progress in zip(outs, batch, caches):
        served = progress.allocation
        assert out.prompt_len == len(prompt) and served.num_blocks == config.cache.blocks_for_tokens(len(prompt))
        with whole_cache.allocate("whole", served.num_blocks) as mine:
            first, = whole.prefill([PrefillJob(prompt=prompt, block_ids=mine.block_ids, ring_id=mine.ring_id)])
            assert out.first_token == first
            assert (node.engine.state_digest(served.block_ids, served.ring_id, len(prompt))
                    == whole.state_digest(mine.block_ids, mine.ring_id, len(prompt)))
        progress.release()  # what the grant does once pulled
    skip.release()
    assert node.cache.free_blocks == NUM_BLOCKS and node.cache.free_rings == NUM_RINGS


def test_progress_is_reported_after_each_chunk():
    config = ModelConfig.build(num_layers=1)
    node = Node(config, budget=40)
    (prompt,) = prompts(config, [100])

    async def scenario():
        loop = asyncio.create_task(node.batcher.run())
        cache = node.progress("r")
        seen: list[int] = []

        async def watch():
            for target in (40, 80, 100):
                await cache.wait_prefilled(target)
                seen.append(cache.prefilled)
        watcher = asyncio.create_task(watch())
        await node.batcher.prefill(PrefillInput(request_id="r", prompt_token_ids=prompt), cache)
        await asyncio.wait_for(watcher, 5)
        cache.release()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        return seen
    assert asyncio.run(scenario()) == [40, 80, 100]


def test_a_caller_leaving_between_chunks_frees_everything_and_stops_its_chunks():
    config = ModelConfig.build(num_layers=1)
    node = Node(config, budget=16)
    (prompt,) = prompts(config, [200])

    async def scenario():
        loop = asyncio.create_task(node.batcher.run())
        cache = node.progress("r")
        call = asyncio.create_task(node.batcher.prefill(PrefillInput(request_id="r", prompt_token_ids=prompt), cache))
        await asyncio.wait_for(cache.wait_prefilled(32), 5)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        while not node.batcher.idle:
            await asyncio.sleep(0.01)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    asyncio.run(scenario())
    assert node.cache.free_blocks == NUM_BLOCKS and node.cache.free_rings == NUM_RINGS
    assert node.engine.steps[-1][0][2] < 200, "the prompt's later chunks must not run"
