"""A consumer prefetches the grants a producer announces to it by name (``prefetch_by``): the producer posts each
held grant on its board, the consumer that asked for its announcements (``AwaitOffers``) pulls it at once into
memory of its own, and the decode request's load then lands from those bytes, byte for byte, with no UCX message
of its own. The prefetch is the grant's pull: a producer that frees grants after a pull frees it then, one that
does not keeps it for the load's Release. A load of another prompt, of held blocks, an engine that never asked:
each is served as before; a request queued here keeps its prefetched bytes past their lease. The
workers run in this process over vLLM's own GLM-5-Next cache specs (cross-layer blocks and a ring group)."""

from __future__ import annotations

import os

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.connector import Announcement, ucx_available  # noqa: E402
from kpool_pd.vllm.metadata import KpoolPdMetadata, Renew, prefetch_target  # noqa: E402
from tests.support.deadlines import patient  # noqa: E402
from tests.support.polling import wait_for  # noqa: E402
from tests.support.vllm_prefetch import following_pair, landed_equal, load_of, offered, prefetched  # noqa: E402
from tests.support.vllm_spec_caches import backing  # noqa: E402
from tests.support.vllm_spec_procs import NUM_BLOCKS  # noqa: E402
from tests.support.ucx_sends import record_sends  # noqa: E402
from tests.support.vllm_worker_pair import wait_finished, wait_freed  # noqa: E402

pytestmark = [pytest.mark.vllm,  # vLLM's config objects, a port of its own
              pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed (pip install 'kpool-pd[ucx]')")]

DONE_S = 60.0


@pytest.fixture(params=[True, False], ids=["release_after_pull", "released_by_the_consumer"])
def pair(request):
    with following_pair("prefetch", release_after_pull=request.param) as workers:
        yield workers


@pytest.fixture
def sends(monkeypatch):
    """The byte count of every UCX message posted in this process (the producer's sends)."""
    return record_sends(monkeypatch)


def test_a_named_consumer_prefetches_and_its_load_sends_nothing(pair, sends):
    producer, producer_caches, consumer, consumer_caches = pair
    address = producer.settings.advertise
    offer, params = offered(producer, "a", consumer.engine_id)
    assert wait_for(lambda: prefetched(consumer, address, offer.key), DONE_S), "the announced grant was not prefetched"
    assert sends, "the prefetch sent nothing"
    prefetch_sends = len(sends)
    if producer.settings.release_after_pull:  # the prefetch was the pull: the grant ended with it
        assert wait_freed(producer, patient(DONE_S)) < patient(DONE_S), "the prefetch did not end the grant"
    else:
        assert producer.cache.allocations_held == 1  # kept for the load's Release
    consumer.load(KpoolPdMetadata(loads=[load_of("a", params)]))
    done, failed = wait_finished(consumer, "a", DONE_S)
    assert done == {"a"} and failed == set()
    assert len(sends) == prefetch_sends, "the load sent a UCX message of its own"
    assert landed_equal(producer_caches, consumer_caches, "a")
    stats = consumer.take_stats().data
    assert stats["prefetch_hits"] == 1 and stats["grants_prefetched"] == 1 and stats["pulls"] == 1
    assert wait_freed(producer, patient(DONE_S)) < patient(DONE_S), "the grant was never freed"
    assert producer.take_stats().data["grants_announced"] == 1
    assert consumer.cache.allocations_held == 0


def test_a_load_with_held_blocks_lands_the_rest_from_the_prefetch(pair, sends):
    producer, producer_caches, consumer, consumer_caches = pair
    address = producer.settings.advertise
    offer, params = offered(producer, "b", consumer.engine_id)
    assert wait_for(lambda: prefetched(consumer, address, offer.key), DONE_S)
    prefetch_sends = len(sends)
    before = backing(consumer_caches).clone()
    consumer.load(KpoolPdMetadata(loads=[load_of("b", params, held=(1,))]))  # the prefix cache holds block 14
    done, failed = wait_finished(consumer, "b", DONE_S)
    assert done == {"b"} and failed == set() and len(sends) == prefetch_sends
    assert landed_equal(producer_caches, consumer_caches, "b", skip=(14,))
    size = before.numel() // NUM_BLOCKS
    assert bool((backing(consumer_caches)[14 * size:15 * size] == before[14 * size:15 * size]).all()), \
        "a held block was written"


def test_a_load_of_another_prompt_does_not_take_the_prefetched_bytes(pair, sends):
    producer, producer_caches, consumer, consumer_caches = pair
    address = producer.settings.advertise
    offer, params = offered(producer, "a", consumer.engine_id)
    assert wait_for(lambda: prefetched(consumer, address, offer.key), DONE_S)
    consumer.load(KpoolPdMetadata(loads=[load_of("a", params, digest_of="not-a")]))
    done, failed = wait_finished(consumer, "a", DONE_S)
    assert done == {"a"} and failed == {"a"}  # its key is not the grant's: refused by the producer, as before
    assert not landed_equal(producer_caches, consumer_caches, "a")
    assert prefetched(consumer, address, offer.key), "the prefetch was dropped by a load that does not match it"
    assert consumer.take_stats().data["prefetch_hits"] == 0


def test_an_engine_that_never_asked_is_announced_nothing_and_its_load_pulls(pair, sends):
    producer, producer_caches, consumer, consumer_caches = pair
    assert not producer.node.offer_board.post("vllm-stranger", Announcement("k", "{}"))
    offer, params = offered(producer, "a", "vllm-stranger")
    consumer.load(KpoolPdMetadata(loads=[load_of("a", params)]))
    done, failed = wait_finished(consumer, "a", DONE_S)
    assert done == {"a"} and failed == set()
    assert landed_equal(producer_caches, consumer_caches, "a")
    stats = consumer.take_stats().data
    assert stats["prefetch_hits"] == 0 and stats["grants_prefetched"] == 0 and stats["pulls"] == 1
    assert producer.take_stats().data.get("grants_announced", 0) == 0


def expire_later(consumer) -> int:
    """``Prefetches.expire`` as if every lease had passed."""
    async def expire():
        return consumer.prefetches.expire(now=10**9)
    return consumer.loop.call(expire)


def test_unclaimed_prefetches_are_dropped_after_their_lease(pair):
    producer, _, consumer, _ = pair
    address = producer.settings.advertise
    offer, _ = offered(producer, "a", consumer.engine_id)
    assert wait_for(lambda: prefetched(consumer, address, offer.key), DONE_S)
    assert expire_later(consumer) == 1
    assert not prefetched(consumer, address, offer.key)
    assert consumer.take_stats().data["prefetches_expired"] == 1


def test_a_queued_requests_prefetch_outlives_its_lease_and_lands(pair, sends):
    producer, producer_caches, consumer, consumer_caches = pair
    address = producer.settings.advertise
    offer, params = offered(producer, "a", consumer.engine_id)
    assert wait_for(lambda: prefetched(consumer, address, offer.key), DONE_S)
    consumer.load(KpoolPdMetadata(renewals=[Renew(request_id="a", address=address, key=offer.key, lease_s=60.0)]))
    assert expire_later(consumer) == 0, "a queued request's prefetched bytes were dropped"
    prefetch_sends = len(sends)
    consumer.load(KpoolPdMetadata(loads=[load_of("a", params)]))
    done, failed = wait_finished(consumer, "a", DONE_S)
    assert done == {"a"} and failed == set() and len(sends) == prefetch_sends
    assert landed_equal(producer_caches, consumer_caches, "a")
    assert consumer.queued_grants() == set()


def test_prefetch_by_names_a_consumer_by_its_vllm_engine_id():
    assert prefetch_target({"do_remote_decode": True, "prefetch_by": "d0"}) == "vllm-d0"
    assert prefetch_target({"do_remote_decode": True}) == ""
    for bad in ("", 7, "x" * 300, None):
        with pytest.raises(ValueError, match="prefetch_by"):
            prefetch_target({"prefetch_by": bad})


def test_prefetch_mib_is_checked_and_zero_turns_prefetching_off():
    from kpool_pd.vllm.settings import KpoolPdSettings
    base = {"producers": ["127.0.0.1:1"], "transport": "grpc"}
    assert KpoolPdSettings.from_extra_config(base, producer=False).prefetch_mib == 256
    assert KpoolPdSettings.from_extra_config(base | {"prefetch_mib": 0}, producer=False).prefetch_mib == 0
    for bad in (-1, 1.5, "64", True):
        with pytest.raises(ValueError, match="prefetch_mib"):
            KpoolPdSettings.from_extra_config(base | {"prefetch_mib": bad}, producer=False)


@pytest.mark.parametrize("engine, secret, wait_ms, code", [
    ("own", b"not-its-secret", 0, "PERMISSION_DENIED"),
    ("vllm-never-handshaken", b"", 0, "FAILED_PRECONDITION"),
    ("own", None, 60_000, "INVALID_ARGUMENT"),
], ids=["wrong_secret", "unknown_engine", "wait_too_long"])
def test_await_offers_refuses_what_it_must_with_a_status_and_a_message(pair, engine, secret, wait_ms, code):
    import grpc

    from kpool_pd.connector import prefill_api as pb
    producer, _, consumer, _ = pair
    address = producer.settings.advertise

    async def ask():
        peer = await consumer.peer(address)
        engine_id = consumer.engine_id if engine == "own" else engine
        request = pb.AwaitOffersRequest(engine_id=engine_id, wait_ms=wait_ms,
                                        engine_secret=peer.context.secrets.get(address) if secret is None else secret)
        try:
            await peer._stub.AwaitOffers(request, timeout=30)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, exc.details()
        return "OK", ""
    got, details = consumer.loop.call(ask)
    assert got == code and details, (got, details)


def test_an_announcement_for_another_producer_is_ignored(pair, caplog):
    import json as jsonlib
    import logging

    from kpool_pd.connector import prefill_api as pb
    producer, _, consumer, _ = pair
    address = producer.settings.advertise
    offer, params = offered(producer, "a", "")  # announced to nobody
    forged = params | {"remote_address": "10.0.0.1:1", "remote_rank_addresses": ["10.0.0.1:1"]}
    announced = pb.AnnouncedOffer(grant_id=offer.key, params_json=jsonlib.dumps(forged))

    async def fetch():
        peer = await consumer.peer(address)
        await consumer.prefetches._fetch(peer, [announced])
        return consumer.prefetches.held_bytes
    with caplog.at_level(logging.WARNING, logger="kpool_pd.vllm.prefetch"):
        assert consumer.loop.call(fetch) == 0
    assert any("ignored" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_failed_prefetch_leaves_the_load_to_its_pull(pair, monkeypatch, caplog):
    import logging

    import kpool_pd.vllm.prefetch as prefetch_module
    producer, producer_caches, consumer, consumer_caches = pair
    address = producer.settings.advertise

    async def broken(*args, **kwargs):
        raise RuntimeError("the test breaks every prefetch")
    monkeypatch.setattr(prefetch_module, "prefetch_packed", broken)
    with caplog.at_level(logging.WARNING, logger="kpool_pd.vllm.prefetch"):
        offer, params = offered(producer, "a", consumer.engine_id)
        assert wait_for(lambda: any("the test breaks every prefetch" in r.getMessage() for r in caplog.records),
                        DONE_S), "the prefetch was never tried"
    assert not consumer.prefetches.has(address, offer.key), "a failed prefetch is still awaited"
    consumer.load(KpoolPdMetadata(loads=[load_of("a", params)]))
    done, failed = wait_finished(consumer, "a", DONE_S)
    assert done == {"a"} and failed == set()
    assert landed_equal(producer_caches, consumer_caches, "a")
    stats = consumer.take_stats().data
    assert stats["pulls"] == 1 and stats["prefetch_hits"] == 0


def test_a_prefetch_in_flight_does_not_hold_back_the_steps_other_pulls(pair, monkeypatch):
    """Two loads in one step, one of them waiting for its grant's prefetch (still in flight here, and then missing):
    the other one's pull lands meanwhile; the first is pulled once its prefetch ended without its bytes, and both
    end together."""
    import asyncio

    producer, producer_caches, consumer, consumer_caches = pair
    offer_a, params_a = offered(producer, "a", "")  # announced to nobody: the test plays its prefetch
    _, params_b = offered(producer, "b", "")

    async def gate():
        return asyncio.Event()
    ended = consumer.loop.call(gate)
    claims = []

    async def claim(address, key, timeout_s):
        claims.append(key)
        await ended.wait()
        return None  # the prefetch brought nothing: the load pulls it
    monkeypatch.setattr(consumer.prefetches, "has", lambda address, key: key == offer_a.key)
    monkeypatch.setattr(consumer.prefetches, "claim", claim)
    consumer.load(KpoolPdMetadata(loads=[load_of("a", params_a), load_of("b", params_b)]))
    assert wait_for(lambda: landed_equal(producer_caches, consumer_caches, "b"), DONE_S), \
        "the other load waited for the prefetch in flight"
    assert claims == [offer_a.key] and not landed_equal(producer_caches, consumer_caches, "a")

    async def end_prefetch():
        ended.set()
    consumer.loop.call(end_prefetch)
    done, failed = wait_finished(consumer, "a", DONE_S)
    assert {"a", "b"} <= done and failed == set()
    assert landed_equal(producer_caches, consumer_caches, "a")
