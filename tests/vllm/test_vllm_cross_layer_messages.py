"""With cross-layer blocks (vLLM's block-outermost caches: a block's bytes for every layer lie together), a
pull through KpoolPdConnector's worker sides moves one UCX message per run of a group's blocks, however many
layers the model has: messages per pull at most (groups x runs). The producer and consumer workers run in
this process over vLLM's own GLM-5-Next cache specs (a full-attention group of many layers and a ring group),
the consumer pulling over UCX."""

from __future__ import annotations

import os
import secrets

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.connector import ucx_available  # noqa: E402
from kpool_pd.transfer_params import DecodeParams  # noqa: E402
from kpool_pd.vllm.metadata import KpoolPdMetadata, Load, Offer, producer_params, released_after_pull  # noqa: E402
from tests.support.vllm_spec_caches import backing  # noqa: E402
from tests.support.vllm_spec_procs import NUM_BLOCKS, spec_digest  # noqa: E402
from tests.support.vllm_worker_pair import started, wait_finished, wait_freed, worker_pair  # noqa: E402

pytestmark = [pytest.mark.vllm,  # vLLM's config objects, a port of its own
              pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed (pip install 'kpool-pd[ucx]')")]

DONE_S = 60.0  # a pull on a loaded 2-core machine
# group 0 (full attention): source blocks 3, 4, 7, 8 into 9, 10, 12, 13: two runs; group 1 (the ring): one block
SRC, DST = ((3, 4, 7, 8), (5,)), ((9, 10, 12, 13), (11,))


def runs(src: tuple[int, ...], dst: tuple[int, ...]) -> int:
    """Runs of blocks consecutive on both sides."""
    return 1 + sum(1 for i in range(1, len(src)) if (src[i] - src[i - 1], dst[i] - dst[i - 1]) != (1, 1))


@pytest.fixture
def pair():
    producer, producer_caches, consumer, consumer_caches = worker_pair(60.0, "cross-layer", transport="ucx")
    with started(producer, consumer):
        yield producer, producer_caches, consumer, consumer_caches


def test_a_pull_of_cross_layer_blocks_is_one_message_per_run(pair):
    producer, producer_caches, consumer, consumer_caches = pair
    layout = consumer.cache.layout
    assert len(layout.block_planes) == 1, "the caches are not block-outermost (one plane holding every layer)"
    layers = len(producer_caches)  # the tensors vLLM keeps, one a layer
    offer = Offer(request_id="cross", grant_id=secrets.token_hex(16), block_ids=SRC, prompt_len=200,
                  prompt_digest=spec_digest("cross", SRC))
    producer.offer(KpoolPdMetadata(offers=[offer]))
    params = producer_params(offer, address=producer.settings.advertise, engine_id=producer.engine_id,
                             lease_s=60.0, released_after_pull=True)
    consumer.load(KpoolPdMetadata(loads=[Load(request_id="cross", params=DecodeParams.parse(params), block_ids=DST,
                                              digest=spec_digest("cross", DST),
                                              released_after_pull=released_after_pull(params))]))
    done, failed = wait_finished(consumer, "cross", DONE_S)
    assert done == {"cross"} and failed == set()
    stats = consumer.take_stats().data
    expected = sum(runs(s, d) for s, d in zip(SRC, DST))  # 2 runs of the full group, the ring's block
    groups = len(SRC)
    assert stats["pulls"] == 1 and stats["pulled_regions"] == expected == 3
    assert stats["pulled_regions"] <= groups * max(runs(s, d) for s, d in zip(SRC, DST)) < layers
    block = backing(producer_caches).numel() // NUM_BLOCKS  # a block of every layer is one byte range
    src, dst = backing(producer_caches), backing(consumer_caches)
    for theirs, ours in zip(SRC, DST):
        for s, d in zip(theirs, ours):
            assert bool((dst[d * block:(d + 1) * block] == src[s * block:(s + 1) * block]).all()), f"block {s}"
    assert wait_freed(producer, DONE_S) < DONE_S  # the grant ended with the pull's last byte
