"""When a producer announces a grant to the consumer its request named (``announce``): at once (``computed``, the
default), or, where a pool in host memory shares its cores with the forward, held until a step computes nothing
(``idle``), and then only the grants still held; a grant its load pulled meanwhile is announced to nobody.
A consumer ignores an announcement of a grant its own load already pulled. The workers run in this process over
vLLM's own GLM-5-Next cache specs."""

from __future__ import annotations

import os

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.connector import ucx_available  # noqa: E402
from kpool_pd.connector import prefill_api as pb  # noqa: E402
from kpool_pd.vllm.metadata import KpoolPdMetadata  # noqa: E402
from kpool_pd.vllm.settings import AnnounceWhen, KpoolPdSettings  # noqa: E402
from tests.support.polling import wait_for  # noqa: E402
from tests.support.vllm_prefetch import following_pair, landed_equal, load_of, offered, prefetched  # noqa: E402
from tests.support.vllm_worker_pair import wait_finished  # noqa: E402

pytestmark = [pytest.mark.vllm,  # vLLM's config objects, a port of its own
              pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed (pip install 'kpool-pd[ucx]')")]

DONE_S = 60.0
BUSY, IDLE = KpoolPdMetadata(idle=False), KpoolPdMetadata(idle=True)


@pytest.fixture
def pair():
    with following_pair("announce", announce="idle") as workers:
        yield workers


def settled(producer) -> int:
    """The announcements waiting on ``producer``'s board for anyone, once everything queued on its loop ran."""
    async def waiting():
        return sum(len(queue) for queue in producer.node.offer_board._queues.values())
    producer.loop.call(waiting)  # the offers' lending and the announcements it starts ran before this
    return producer.loop.call(waiting)


def announced(producer) -> int:
    return producer.take_stats().data.get("grants_announced", 0)


def test_an_idle_announcing_producer_announces_at_the_first_idle_step(pair):
    producer, producer_caches, consumer, consumer_caches = pair
    assert producer.announce is AnnounceWhen.IDLE
    address = producer.settings.advertise
    offer, params = offered(producer, "a", consumer.engine_id)
    producer.before_forward(BUSY)  # a step that computes: nothing is announced beside its forward
    assert settled(producer) == 0 and not prefetched(consumer, address, offer.key)
    assert announced(producer) == 0
    producer.before_forward(IDLE)
    assert wait_for(lambda: prefetched(consumer, address, offer.key), DONE_S), "the idle step announced nothing"
    consumer.load(KpoolPdMetadata(loads=[load_of("a", params)]))
    done, failed = wait_finished(consumer, "a", DONE_S)
    assert done == {"a"} and failed == set()
    assert landed_equal(producer_caches, consumer_caches, "a")
    assert consumer.take_stats().data["prefetch_hits"] == 1
    assert announced(producer) == 1


def test_a_grant_pulled_before_the_idle_step_is_announced_to_nobody(pair):
    producer, producer_caches, consumer, consumer_caches = pair
    offer, params = offered(producer, "a", consumer.engine_id)
    consumer.load(KpoolPdMetadata(loads=[load_of("a", params)]))
    done, failed = wait_finished(consumer, "a", DONE_S)
    assert done == {"a"} and failed == set() and landed_equal(producer_caches, consumer_caches, "a")
    assert wait_for(lambda: producer.cache.allocations_held == 0, DONE_S), "the pulled grant was never freed"
    producer.before_forward(IDLE)
    assert settled(producer) == 0, "a grant already pulled was announced"
    assert announced(producer) == 0
    assert consumer.take_stats().data.get("grants_prefetched", 0) == 0


def test_a_consumer_ignores_an_announcement_of_a_grant_its_load_pulled(pair, monkeypatch):
    import json

    import kpool_pd.vllm.prefetch as prefetch_module
    producer, producer_caches, consumer, consumer_caches = pair
    address = producer.settings.advertise
    offer, params = offered(producer, "a", consumer.engine_id)
    consumer.load(KpoolPdMetadata(loads=[load_of("a", params)]))
    done, failed = wait_finished(consumer, "a", DONE_S)
    assert done == {"a"} and failed == set()
    tried = []

    async def recorded(peer, grants, **kwargs):
        tried.extend(grants)
        return [RuntimeError("not sent")] * len(grants)
    monkeypatch.setattr(prefetch_module, "prefetch_packed", recorded)
    late = pb.AnnouncedOffer(grant_id=offer.key, params_json=json.dumps(params))

    async def fetch():
        peer = await consumer.peer(address)
        await consumer.prefetches._fetch(peer, [late])
        return consumer.prefetches.held_bytes
    assert consumer.loop.call(fetch) == 0
    assert tried == [], "a grant its load pulled was fetched again"


def test_announce_is_checked_and_computed_by_default():
    base = {"listen": "127.0.0.1:1"}
    assert KpoolPdSettings.from_extra_config(base, producer=True).announce is AnnounceWhen.COMPUTED
    for value in ("idle", "computed"):
        assert KpoolPdSettings.from_extra_config(base | {"announce": value}, producer=True).announce \
            is AnnounceWhen(value)
    for bad in ("later", "auto", 1, None):
        with pytest.raises(ValueError, match="announce"):
            KpoolPdSettings.from_extra_config(base | {"announce": bad}, producer=True)
