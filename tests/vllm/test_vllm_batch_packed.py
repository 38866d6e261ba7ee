"""A consumer's UCX loads of one step go to their producer as one batch (PackedPull): the producer checks every
grant, sends their bytes in one UCX message, and the consumer reports the whole batch in one ``get_finished``.
(A batch's message travels in pieces of ``PIECE_BYTES``: these requests' bytes are one.) A request refused
in a batch fails alone, with its reason, and frees what it held; the others land byte for
byte. The producer and consumer workers run in this process over vLLM's own GLM-5-Next cache specs (a
full-attention group and a ring group, cross-layer blocks)."""

from __future__ import annotations

import logging
import os
import secrets

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.connector import ucx_available  # noqa: E402
from kpool_pd.connector.shared.packed_staging import PIECE_BYTES  # noqa: E402
from kpool_pd.transfer_params import DecodeParams  # noqa: E402
from kpool_pd.vllm.metadata import KpoolPdMetadata, Load, Offer, producer_params, released_after_pull  # noqa: E402
from tests.support.deadlines import patient  # noqa: E402
from tests.support.vllm_spec_caches import backing  # noqa: E402
from tests.support.vllm_spec_procs import NUM_BLOCKS, spec_digest  # noqa: E402
from tests.support.ucx_sends import record_sends  # noqa: E402
from tests.support.vllm_worker_pair import started, wait_finished, wait_freed, worker_pair  # noqa: E402

pytestmark = [pytest.mark.vllm,  # vLLM's config objects, a port of its own
              pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed (pip install 'kpool-pd[ucx]')")]

DONE_S = 60.0  # a batch on a loaded 2-core machine
# per request: (source blocks per group, destination blocks per group); the groups: full attention, the ring
MOVES = {"a": (((1, 2), (3,)), ((1, 2), (3,))),
         "b": (((4, 5, 6), (7,)), ((8, 9, 10), (11,))),
         "c": (((12, 16), (17,)), ((18, 19), (20,)))}


@pytest.fixture
def pair():
    producer, producer_caches, consumer, consumer_caches = worker_pair(60.0, "batch", transport="ucx")
    with started(producer, consumer):
        yield producer, producer_caches, consumer, consumer_caches


@pytest.fixture
def sends(monkeypatch):
    """Every UCX message posted in this process (the producer's sends; the consumer sends none)."""
    return record_sends(monkeypatch)


def offered(producer, request_id: str) -> tuple[Offer, dict]:
    src, _ = MOVES[request_id]
    offer = Offer(request_id=request_id, grant_id=secrets.token_hex(16), block_ids=src, prompt_len=200,
                  prompt_digest=spec_digest(request_id, src))
    producer.offer(KpoolPdMetadata(offers=[offer]))
    return offer, producer_params(offer, address=producer.settings.advertise, engine_id=producer.engine_id,
                                  lease_s=60.0, released_after_pull=True)


def load_of(request_id: str, params: dict, *, digest_of: str | None = None) -> Load:
    """The consumer's load of ``request_id`` (its digest: that of ``digest_of``'s prompt when given, a prompt
    that is not the one the producer computed)."""
    _, dst = MOVES[request_id]
    return Load(request_id=request_id, params=DecodeParams.parse(params), block_ids=dst,
                digest=spec_digest(digest_of or request_id, dst), released_after_pull=released_after_pull(params))


def landed_equal(producer_caches, consumer_caches, request_id: str) -> bool:
    """Whether every block of ``request_id`` holds the producer's bytes (a block of every layer is one byte
    range: cross-layer blocks)."""
    src_all, dst_all = MOVES[request_id]
    src, dst = backing(producer_caches), backing(consumer_caches)
    block = src.numel() // NUM_BLOCKS
    return all(bool((dst[d * block:(d + 1) * block] == src[s * block:(s + 1) * block]).all())
               for theirs, ours in zip(src_all, dst_all) for s, d in zip(theirs, ours))


def wait_all(consumer, request_ids: set[str]) -> tuple[set[str], set[str], int]:
    """(ended, failed, the get_finished calls that reported some) once all of ``request_ids`` ended."""
    done, failed, reporting = set(), set(), 0
    while not request_ids <= done:
        finished, lost = wait_finished(consumer, next(iter(request_ids - done)), DONE_S)
        if not finished and not lost:
            break
        reporting += 1
        done, failed = done | finished, failed | lost
    return done, failed, reporting


def test_a_step_of_three_requests_is_one_message_and_one_report(pair, sends):
    producer, producer_caches, consumer, consumer_caches = pair
    layout = consumer.cache.layout
    assert len(layout.block_planes) == 1, "the caches are not block-outermost (one plane holding every layer)"
    loads = [load_of(rid, offered(producer, rid)[1]) for rid in MOVES]
    consumer.load(KpoolPdMetadata(loads=loads))
    done, failed, reporting = wait_all(consumer, set(MOVES))
    assert done == set(MOVES) and failed == set()
    assert reporting == 1, "the batch's requests were reported in several get_finished calls"
    stats = consumer.take_stats().data
    assert stats["pulls"] == 3 and sum(sends) == stats["pulled_bytes"]  # the three pulls' bytes, all in the batch
    pieces = -(-stats["pulled_bytes"] // PIECE_BYTES)
    assert len(sends) == pieces == 1, f"{len(sends)} UCX messages for one step's batch of {pieces} pieces: {sends}"
    assert stats["pulled_regions"] > len(sends)  # one region a run of blocks: more than the batch's messages
    for rid in MOVES:
        assert landed_equal(producer_caches, consumer_caches, rid), rid
    assert wait_freed(producer, patient(DONE_S)) < patient(DONE_S)  # every grant ended with the batch's send
    assert consumer.cache.allocations_held == 0


def test_a_refused_request_fails_alone_and_the_rest_land(pair, sends, caplog):
    producer, producer_caches, consumer, consumer_caches = pair
    good = {rid: offered(producer, rid)[1] for rid in ("a", "c")}
    _, params_b = offered(producer, "b")
    loads = [load_of("a", good["a"]),
             load_of("b", params_b, digest_of="not-b"),  # another prompt than the producer's: no grant for it
             load_of("c", good["c"])]
    with caplog.at_level(logging.WARNING, logger="kpool_pd.vllm.consumer_worker"):
        consumer.load(KpoolPdMetadata(loads=loads))
        done, failed, reporting = wait_all(consumer, set(MOVES))
    assert done == set(MOVES) and failed == {"b"} and reporting == 1
    assert any("request b failed" in r.getMessage() and "unknown, released or expired" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert landed_equal(producer_caches, consumer_caches, "a") and landed_equal(producer_caches, consumer_caches, "c")
    assert not landed_equal(producer_caches, consumer_caches, "b")  # the seeds differ: nothing was written there
    assert len(sends) == 1
    assert consumer.cache.allocations_held == 0  # the refused request's blocks are vLLM's again
    stats = consumer.take_stats().data
    assert stats["pulls"] == 2 and stats["pull_failures"] == 1
    # the producer still holds b's grant for its own prompt (prompt binding); a and c ended with the send
    assert producer.cache.allocations_held == 1
    producer.before_forward(KpoolPdMetadata(withdrawals=["b"]))
    assert wait_freed(producer, patient(DONE_S)) < patient(DONE_S)
