"""Ranks without engines (``kpool_pd.vllm.ranks``, ``kpool_pd.vllm.rank_params``, ``kpool_pd.vllm.units``,
``kpool_pd.vllm.scheduler.ConsumerScheduler``): which producer ranks each consumer rank reads under vLLM's
rules for heterogeneous TP, for caches split by head and replicated ones; the plans no grant can serve
refused with the sizes named; every rank's port, DP ranks included; a producer's ranks in
kv_transfer_params checked field by field; and the grants a consumer engine's ranks renew, pull and
release."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

if os.environ.get("KPOOLPD_REQUIRE_VLLM") != "1":  # CI (.ci/run) requires it: a missing vLLM fails there
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'kpool-pd[vllm]', see README)")

from kpool_pd.transfer_params import DecodeParams, prompt_digest  # noqa: E402
from kpool_pd.vllm.groups import GroupKind, GroupRule  # noqa: E402
from kpool_pd.vllm.guard import params_error  # noqa: E402
from kpool_pd.vllm.metadata import Offer, producer_params  # noqa: E402
from kpool_pd.vllm.rank_params import RankParams  # noqa: E402
from kpool_pd.vllm.ranks import (EngineRanks, RankSeat, Read, Sharding, plan_reads, rank_heads,  # noqa: E402
                                 rank_port, slot_key)
from kpool_pd.vllm.scheduler import ConsumerScheduler  # noqa: E402
from kpool_pd.vllm.settings import KpoolPdSettings  # noqa: E402
from kpool_pd.vllm.units import unit_ids  # noqa: E402

BY_HEAD, REPLICATED, MIXED = Sharding.BY_HEAD, Sharding.REPLICATED, Sharding.MIXED


def reads(local_tp: int, remote_tp: int, heads: int, sharding: Sharding = BY_HEAD):
    """Each consumer rank's reads as (producer rank, its slots, our slots, whole)."""
    plan = plan_reads(local_tp=local_tp, remote_tp=remote_tp, total_heads=heads, sharding=sharding)
    return [[(r.remote_rank, r.remote_slots, r.local_slots, r.whole) for r in rank] for rank in plan.reads]


def test_rank_heads_split_and_replicate_as_vllm_does():
    assert [rank_heads(r, 2, 4) for r in range(2)] == [(0, 1), (2, 3)]
    assert [rank_heads(r, 4, 2) for r in range(4)] == [(0,), (0,), (1,), (1,)]  # TP above the heads: replicas
    for rank, tp, heads in ((2, 2, 4), (0, 3, 4), (0, 3, 2), (-1, 1, 1), (0, 0, 1)):
        with pytest.raises(ValueError):
            rank_heads(rank, tp, heads)


def test_producer_tp2_to_consumer_tp1_reads_one_half_from_each_rank():
    """NixlConnector's D TP < P TP: the one consumer rank pulls each producer rank's whole grant into its
    own half of the heads."""
    assert reads(1, 2, 2) == [[(0, (0,), (0,), True), (1, (0,), (1,), True)]]
    assert reads(1, 2, 8) == [[(0, (0, 1, 2, 3), (0, 1, 2, 3), True), (1, (0, 1, 2, 3), (4, 5, 6, 7), True)]]


def test_producer_tp1_to_consumer_tp2_reads_each_ranks_slice_of_the_one_rank():
    """D TP > P TP: each consumer rank pulls the slot grants of its heads from the one producer rank,
    whose whole grant nobody pulls (it is released once the load ended)."""
    plan = plan_reads(local_tp=2, remote_tp=1, total_heads=2, sharding=BY_HEAD)
    assert reads(2, 1, 2) == [[(0, (0,), (0,), False)], [(0, (1,), (0,), False)]]
    assert plan.unread == (0,) and plan.slot_grants and (plan.local_units, plan.remote_units) == (1, 2)


def test_equal_tp_reads_the_same_rank_whole():
    assert reads(2, 2, 2) == [[(0, (0,), (0,), True)], [(1, (0,), (0,), True)]]
    assert reads(1, 1, 2) == [[(0, (0, 1), (0, 1), True)]]
    assert plan_reads(local_tp=2, remote_tp=2, total_heads=2, sharding=BY_HEAD).unread == ()


def test_replicated_heads_are_read_from_one_rank_each():
    """P TP 4 over 2 KV heads holds each head twice: the consumer reads ranks 0 and 2 (NixlConnector's
    dedup) and releases 1 and 3 unread."""
    assert reads(1, 4, 2) == [[(0, (0,), (0,), True), (2, (0,), (1,), True)]]
    assert plan_reads(local_tp=1, remote_tp=4, total_heads=2, sharding=BY_HEAD).unread == (1, 3)


def test_replicated_caches_are_read_from_one_remote_rank():
    """MLA, the indexer pages, the rings: consumer rank d reads producer rank d * Tp // Td whole."""
    assert reads(1, 2, 1, REPLICATED) == [[(0, (0,), (0,), True)]]
    assert reads(2, 4, 1, REPLICATED) == [[(0, (0,), (0,), True)], [(2, (0,), (0,), True)]]
    assert plan_reads(local_tp=2, remote_tp=4, total_heads=1, sharding=REPLICATED).unread == (1, 3)
    assert reads(2, 2, 1, MIXED) == [[(0, (0,), (0,), True)], [(1, (0,), (0,), True)]]


@pytest.mark.parametrize("local_tp,remote_tp,heads,sharding,named", [
    (2, 3, 6, BY_HEAD, "one must divide the other"),
    (2, 1, 1, REPLICATED, "2 would read each"),  # two consumer ranks would claim the one producer rank's grant
    (4, 1, 2, BY_HEAD, "would both read"),  # the consumer replicates heads the producer holds once
    (1, 2, 2, MIXED, "equal TP"),
    (1, 0, 2, BY_HEAD, "remote_tp_size"),
], ids=str)
def test_a_plan_no_grant_serves_is_refused_naming_the_sizes(local_tp, remote_tp, heads, sharding, named):
    with pytest.raises(ValueError, match=named):
        plan_reads(local_tp=local_tp, remote_tp=remote_tp, total_heads=heads, sharding=sharding)


def test_every_rank_of_every_dp_rank_serves_on_a_port_of_its_own():
    ports = {rank_port(7600, dp_index=dp, tp_size=2, tp_rank=r) for dp in range(3) for r in range(2)}
    assert ports == set(range(7600, 7606))
    assert RankSeat(tp_rank=1, tp_size=2, dp_index=1).port(7600) == 7603
    assert RankSeat().engine_id("vllm-e") == "vllm-e" and RankSeat(tp_rank=1, tp_size=2).engine_id("e") == "e-tp1"
    with pytest.raises(ValueError, match="65535"):
        rank_port(65535, dp_index=0, tp_size=2, tp_rank=1)
    with pytest.raises(ValueError, match="rank"):
        RankSeat(tp_rank=2, tp_size=2)


def test_unit_ids_name_each_head_slot_of_each_block():
    """Slot h of vLLM block b is unit b * units + h; with two groups the connector's id is unit * 2 + group."""
    layout = SimpleNamespace(num_groups=2, block_id=lambda group, block: block * 2 + group)
    assert unit_ids(layout, ((3, 4),), units=2, slots=(0, 1)) == (12, 14, 16, 18)  # the run stays a run
    assert unit_ids(layout, ((3, 4),), units=2, slots=(1,)) == (14, 18)
    assert unit_ids(layout, ((3,), (5,)), units=1, slots=(0,)) == (6, 11)
    with pytest.raises(ValueError, match="slots"):
        unit_ids(layout, ((3,),), units=2, slots=(2,))


# a producer's ranks in kv_transfer_params ----------------------------------------------------------------
PROMPT = list(range(3, 40))
ADDRESSES = ["127.0.0.1:7600", "127.0.0.1:7601"]


def tp2_params() -> dict:
    offer = Offer(request_id="r", grant_id="ab" * 16, block_ids=((1, 2, 3),), prompt_len=len(PROMPT),
                  prompt_digest=prompt_digest(PROMPT, [3]))
    return producer_params(offer, address=ADDRESSES[0], engine_id="vllm-p", lease_s=30, rank_addresses=ADDRESSES)


def test_a_producers_ranks_travel_in_its_params():
    params = tp2_params()
    assert params["remote_tp_size"] == 2 and params["remote_rank_addresses"] == ADDRESSES
    assert RankParams.parse(params) == RankParams(tp_size=2, addresses=tuple(ADDRESSES))
    single = {k: v for k, v in params.items() if k not in ("remote_tp_size", "remote_rank_addresses")}
    assert RankParams.parse(single) == RankParams(tp_size=1, addresses=(ADDRESSES[0],))  # one rank's params


@pytest.mark.parametrize("change,field", [
    ({"remote_tp_size": 0}, "remote_tp_size"), ({"remote_tp_size": "2"}, "remote_tp_size"),
    ({"remote_tp_size": True}, "remote_tp_size"), ({"remote_tp_size": 1 << 20}, "remote_tp_size"),
    ({"remote_tp_size": 3}, "remote_rank_addresses"), ({"remote_rank_addresses": ADDRESSES[:1]}, "remote_rank_addresses"),
    ({"remote_rank_addresses": "127.0.0.1:7600"}, "remote_rank_addresses"),
    ({"remote_rank_addresses": [ADDRESSES[0], 7601]}, r"remote_rank_addresses'\]\[1\]"),
    ({"remote_rank_addresses": [ADDRESSES[0], "10.0.0.1"]}, r"remote_rank_addresses'\]\[1\]"),
    ({"remote_rank_addresses": ["unix:/tmp/kpoolpd.sock", ADDRESSES[1]]}, r"remote_rank_addresses'\]\[0\]"),
], ids=str)
def test_a_bad_rank_field_is_named(change, field):
    params = tp2_params() | change
    with pytest.raises(ValueError, match=field):
        RankParams.parse(params)
    assert "remote_" in params_error(b'{"kv_transfer_params": %s}' % __import__("json").dumps(params).encode())


def test_rank_0_is_dialed_at_remote_address():
    """A proxy that rewrites remote_address is followed for rank 0 (as with one rank); the allowlist still
    decides whether any rank's address is dialed."""
    params = tp2_params() | {"remote_address": "127.0.0.1:9000"}
    assert RankParams.parse(params).addresses == ("127.0.0.1:9000", ADDRESSES[1])


def test_missing_rank_addresses_are_named():
    params = {k: v for k, v in tp2_params().items() if k != "remote_rank_addresses"}
    with pytest.raises(ValueError, match="remote_rank_addresses.*missing"):
        RankParams.parse(params)


# what a consumer engine of TP 2 renews, loads and releases -----------------------------------------------
def consumer(tp: int = 2) -> ConsumerScheduler:
    settings = KpoolPdSettings.from_extra_config({"transport": "grpc", "producers": ["127.0.0.1"]}, producer=False)
    return ConsumerScheduler(settings, (GroupRule(group=0, kind=GroupKind.FULL, block_size=16),),
                             EngineRanks(tp_size=tp, total_heads=2, sharding=BY_HEAD))


def request(params, request_id="d1", status="WAITING"):
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params, prompt_token_ids=list(PROMPT),
                           num_prompt_tokens=len(PROMPT), status=SimpleNamespace(name=status))


def step(scheduler):
    return scheduler.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1))


def test_each_consumer_rank_renews_and_releases_the_grants_it_reads():
    """Producer TP 2 to consumer TP 2: rank r renews and, if the request never loads, releases producer
    rank r's whole grant."""
    scheduler, key = consumer(), DecodeParams.parse(tp2_params()).key
    scheduler.on_new_request(request(tp2_params()))
    assert [(r.rank, r.address, r.key) for r in step(scheduler).renewals] == [(0, ADDRESSES[0], key),
                                                                            (1, ADDRESSES[1], key)]
    scheduler.request_finished(request(tp2_params(), status="FINISHED_ABORTED"), ([],))
    assert [(r.rank, r.address, r.key) for r in step(scheduler).releases] == [(0, ADDRESSES[0], key),
                                                                            (1, ADDRESSES[1], key)]


def test_a_producer_rank_nobody_pulls_whole_is_released_once_the_load_ended():
    """Producer TP 1 to consumer TP 2: the ranks pull slot grants; the whole grant goes once both ranks'
    loads ended (vLLM's finished receiving), not before (its end releases the unclaimed slot grants)."""
    offer = Offer(request_id="r", grant_id="cd" * 16, block_ids=((1, 2, 3),), prompt_len=len(PROMPT),
                  prompt_digest=prompt_digest(PROMPT, [3]))
    params = producer_params(offer, address=ADDRESSES[0], engine_id="vllm-p", lease_s=30, rank_addresses=ADDRESSES[:1])
    scheduler, key = consumer(), DecodeParams.parse(params).key
    req = request(params)
    scheduler.on_new_request(req)
    assert [(r.rank, r.key) for r in step(scheduler).renewals] == [(0, slot_key(key, 0)), (1, slot_key(key, 1))]
    assert scheduler.get_num_new_matched_tokens(req, 0) == (len(PROMPT), True)
    scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7],), blocks=((),)), len(PROMPT))
    meta = step(scheduler)
    assert len(meta.loads) == 1 and meta.releases == []
    scheduler.update_connector_output(SimpleNamespace(finished_recving={"d1"}))
    assert [(r.rank, r.address, r.key) for r in step(scheduler).releases] == [(0, ADDRESSES[0], key)]


def test_params_of_a_tp_this_engine_cannot_read_compute_here_and_release():
    """Producer TP 3 for a consumer of TP 2: refused (the sizes named in the log), the prompt computed
    here, and the grant the params name released."""
    params = tp2_params() | {"remote_tp_size": 3, "remote_rank_addresses": ADDRESSES + ["127.0.0.1:7602"]}
    scheduler = consumer()
    assert scheduler.get_num_new_matched_tokens(request(params), 0) == (0, False)
    meta = step(scheduler)
    assert meta.loads == [] and [r.key for r in meta.releases] == [DecodeParams.parse(tp2_params()).key]


def test_read_validates_its_slots():
    with pytest.raises(ValueError):
        Read(remote_rank=0, remote_slots=(0, 1), local_slots=(0,), whole=True)
    with pytest.raises(ValueError):
        Read(remote_rank=0, remote_slots=(0, 1), local_slots=(0, 1), whole=False)
