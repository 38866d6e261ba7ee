"""The one prompt check (``model.check_prompt``) and the callers that turn its ValueError into their status."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from kpool_pd.connector import PrefillInput, PrefillProgress
from kpool_pd.kvcache import NodeCache
from kpool_pd.model import Engine, ModelConfig, PrefillJob, check_prompt
from kpool_pd.prefill_worker.batcher import BatchingPrefillEngine


def test_a_good_prompt_comes_back_as_a_tuple():
    assert check_prompt([0, 5, 9], vocab_size=10) == (0, 5, 9)
    assert check_prompt(range(4), vocab_size=4, max_len=4) == (0, 1, 2, 3)  # both ends of both ranges
    assert check_prompt((7,), vocab_size=8, max_len=1) == (7,)


@pytest.mark.parametrize("prompt, max_len, message", [
    pytest.param([], None, r"prompt has 0 tokens; must have at least 1$", id="empty"),
    pytest.param([], 3, r"prompt has 0 tokens; must have 1 to 3$", id="empty-with-limit"),
    pytest.param([1, 2, 3, 4], 3, r"prompt has 4 tokens; must have 1 to 3$", id="one-over"),
    pytest.param([1, 10, 2], None, r"must be in \[0, 10\) \(the vocabulary\), got \[10\]$", id="vocab-size"),
    pytest.param([-1, 3], None, r"got \[-1\]$", id="negative"),
    pytest.param([1, 2.0, True], None, r"got \[2.0, True\]$", id="float-and-bool"),
    pytest.param(list(range(20, 40)), None, r"got \[20, 21, 22, 23, 24\]$", id="names-the-first-five"),
])
def test_a_bad_prompt_is_refused_naming_the_values(prompt, max_len, message):
    with pytest.raises(ValueError, match=message):
        check_prompt(prompt, vocab_size=10, max_len=max_len)


def test_the_engine_refuses_a_bad_prompt_before_it_writes_anything():
    config = ModelConfig.build(num_layers=1, vocab_size=16)
    cache = NodeCache(config.cache, num_blocks=2, num_rings=1)
    engine = Engine(config, cache.pool)
    cache.pool.blocks.fill_(0x5A)
    before = cache.pool.blocks.clone()
    for prompt, message in (([], "prompt has 0 tokens"), ([3, 16], r"must be in \[0, 16\)")):
        with pytest.raises(ValueError, match=message):
            engine.prefill([PrefillJob(prompt=prompt, block_ids=[0, 1], ring_id=0)])
    assert cache.pool.blocks.equal(before)


def test_the_prefill_engine_refuses_a_bad_prompt_counts_it_and_takes_nothing():
    config = ModelConfig.build(num_layers=1)
    cache = NodeCache(config.cache, num_blocks=4, num_rings=2)
    registry = CollectorRegistry()
    batcher = BatchingPrefillEngine(Engine(config, cache.pool), cache, max_batch_tokens=64, max_queue=4,
                                    registry=registry)
    progress = PrefillProgress("r0")
    bad = PrefillInput(request_id="r0", prompt_token_ids=[1, config.vocab_size])
    with pytest.raises(ValueError, match=rf"must be in \[0, {config.vocab_size}\) \(the vocabulary\), got \[1024\]"):
        asyncio.run(batcher.prefill(bad, progress))
    assert (cache.free_blocks, cache.free_rings, progress.allocation) == (4, 2, None)
    assert registry.get_sample_value("kpoolpd_prefill_requests_total", {"outcome": "invalid"}) == 1.0
