"""The requests the prefetch tests move between a producer and a consumer worker (``tests.support.vllm_worker_pair``)
over vLLM's GLM-5-Next cache specs: their offers, their loads, and checks on what landed. Import it after the test
has checked that vLLM is installed."""

from __future__ import annotations

import contextlib
import secrets

from kpool_pd.transfer_params import DecodeParams
from kpool_pd.vllm.metadata import KpoolPdMetadata, Load, Offer, producer_params, released_after_pull
from tests.support.polling import wait_for
from tests.support.vllm_spec_caches import backing
from tests.support.vllm_spec_procs import NUM_BLOCKS, spec_digest
from tests.support.vllm_worker_pair import started, worker_pair

FOLLOW_S = 60.0  # the longest a consumer may take to ask its new producer for announcements

# per request: (source blocks per group, destination blocks per group); the groups: full attention, the ring
MOVES = {"a": (((1, 2), (3,)), ((5, 6), (7,))),
         "b": (((4, 8, 9), (10,)), ((12, 14, 15), (16,)))}


@contextlib.contextmanager
def following_pair(name: str, **settings):
    """A started producer and UCX consumer worker (``worker_pair`` with ``settings``), the consumer handshaken and
    asking the producer for its announcements: (producer, its caches, consumer, its caches)."""
    producer, producer_caches, consumer, consumer_caches = worker_pair(60.0, name, transport="ucx", **settings)
    with started(producer, consumer):
        address = producer.settings.advertise
        consumer.loop.call(lambda: consumer.peer(address))  # handshaken: the consumer follows the producer
        assert wait_for(lambda: producer.node.offer_board.listening(consumer.engine_id), FOLLOW_S), \
            "the consumer never asked the producer for its announcements"
        yield producer, producer_caches, consumer, consumer_caches


def offered(producer, request_id: str, prefetch_by: str) -> tuple[Offer, dict]:
    """Offer ``request_id``'s blocks on ``producer`` (a step's metadata, naming ``prefetch_by``): (the offer, the
    params its decode request carries)."""
    src, _ = MOVES[request_id]
    offer = Offer(request_id=request_id, grant_id=secrets.token_hex(16), block_ids=src, prompt_len=200,
                  prompt_digest=spec_digest(request_id, src), prefetch_by=prefetch_by)
    producer.offer(KpoolPdMetadata(offers=[offer]))
    return offer, producer_params(offer, address=producer.settings.advertise, engine_id=producer.engine_id,
                                  lease_s=60.0, rank_addresses=(producer.settings.advertise,),
                                  released_after_pull=producer.settings.release_after_pull)


def load_of(request_id: str, params: dict, *, digest_of: str | None = None, held=()) -> Load:
    """The consumer's load of ``request_id`` with ``params`` (its prompt's digest, or ``digest_of``'s)."""
    _, dst = MOVES[request_id]
    return Load(request_id=request_id, params=DecodeParams.parse(params), block_ids=dst, held=tuple(held),
                digest=spec_digest(digest_of or request_id, dst), released_after_pull=released_after_pull(params))


def block_equal(producer_caches, consumer_caches, src: int, dst: int) -> bool:
    theirs, ours = backing(producer_caches), backing(consumer_caches)
    size = theirs.numel() // NUM_BLOCKS
    return bool((ours[dst * size:(dst + 1) * size] == theirs[src * size:(src + 1) * size]).all())


def landed_equal(producer_caches, consumer_caches, request_id: str, skip=()) -> bool:
    src_all, dst_all = MOVES[request_id]
    return all(block_equal(producer_caches, consumer_caches, s, d)
               for theirs, ours in zip(src_all, dst_all) for s, d in zip(theirs, ours) if d not in skip)


def prefetched(consumer, address: str, key: str) -> bool:
    """Whether ``consumer`` holds grant ``key`` of ``address`` prefetched."""
    async def held():
        return (address, key) in consumer.prefetches._held
    return consumer.loop.call(held)
