"""Decode-context parallel at the model level: N decode ranks, each holding only its own pools and
tokens plus the whole ring, equal the colocated run byte for byte (tokens, output digest, state
digest), whatever N and the interleave.

The boundary matrix runs on real rank processes joined by gloo; the property tests run the ranks as
threads of one process (same collectives through a shared exchange) so the rank count can be an
axis of many examples.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.dcp_ranks import DcpCase, decode_on_ranks, run_processes, run_threads
from hypothesis import given, settings
from hypothesis import strategies as st

from kpool_pd.kernels import kpool_indexer_topk
from kpool_pd.kvcache import CacheFamily, DcpConfig, DcpShard, tail_ring_size
from kpool_pd.model import ModelConfig
from kpool_pd.model.colocated import GenerateRequest, make_prompts, run_colocated
from kpool_pd.model.dcp_group import backend_for
from kpool_pd.model.dcp_topk import merge_topk

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 9


def _boundary_lengths(config: ModelConfig, interleave: int, ranks: int) -> list[int]:
    """Prompt lengths on each side of a pool, ring, block and interleave boundary (and of one round
    of every rank)."""
    kpool, block = config.cache.kpool, config.cache.block_size
    ring = tail_ring_size(kpool, config.cache.num_spec)
    edges = {kpool, ring, block, interleave, interleave * ranks, 2 * interleave + kpool}
    lengths = {1} | {e + d for e in edges for d in (-1, 0, 1)}
    return sorted(n for n in lengths if n >= 1)


def _requests(lengths: list[int], seed: int) -> tuple[GenerateRequest, ...]:
    base = make_prompts(len(lengths), max(lengths), seed=seed, vocab_size=1024, max_tokens=MAX_TOKENS)
    return tuple(GenerateRequest(request_id=r.request_id, prompt=r.prompt[:n], max_tokens=MAX_TOKENS)
                 for r, n in zip(base, lengths))


def _reference(case: DcpCase) -> list[tuple[tuple[int, ...], str, str]]:
    results = run_colocated(case.config, case.requests, max_batch=len(case.requests))
    return [(r.tokens, r.output_digest, r.state_digest) for r in results]


def _matrix(ranks: int) -> list[DcpCase]:
    """kpool 2/4/8 x drafts 0/3, the interleave in turn one pool, one block, and three pools (which
    neither divides nor is a multiple of the block): each interleave twice, once with drafts."""
    cases = []
    for i, (kpool, num_spec) in enumerate((k, s) for k in (2, 4, 8) for s in (0, 3)):
        config = ModelConfig.build(kpool=kpool, num_spec=num_spec, num_layers=2)
        interleave = (kpool, None, 3 * kpool)[i % 3]
        resolved = interleave or config.cache.block_size
        cases.append(DcpCase(config=config, interleave=interleave,
                             requests=_requests(_boundary_lengths(config, resolved, ranks), seed=i)))
    return cases


@pytest.mark.parametrize("ranks", [2, 4], ids=lambda n: f"dcp{n}")
def test_rank_processes_equal_the_colocated_run(ranks):
    cases = _matrix(ranks)
    if ranks > 2:  # every kpool and interleave, with drafts: the two-rank run has every combination
        cases = cases[1::2]
    got = run_processes(ranks, cases)
    for case, results in zip(cases, got):
        expected = _reference(case)
        what = f"kpool {case.config.cache.kpool}, drafts {case.config.cache.num_spec}, interleave {case.interleave}"
        assert [r[0] for r in results] == [e[0] for e in expected], f"tokens differ ({what})"
        assert results == expected, f"digests differ ({what})"


@settings(max_examples=12, deadline=None)
@given(ranks=st.integers(1, 4), kpool=st.sampled_from([2, 4, 8]), num_spec=st.sampled_from([0, 1, 3]),
       pools_per_chunk=st.integers(1, 40), data=st.data())
def test_any_rank_count_and_interleave_equal_the_colocated_run(ranks, kpool, num_spec, pools_per_chunk, data):
    config = ModelConfig.build(kpool=kpool, num_spec=num_spec, num_layers=1)
    interleave = kpool * pools_per_chunk
    lengths = data.draw(st.lists(st.integers(1, 2 * interleave * ranks + kpool), min_size=1, max_size=3))
    requests = _requests(lengths, seed=data.draw(st.integers(0, 50)))
    case = DcpCase(config=config, interleave=interleave, requests=requests)
    results = run_threads(ranks, interleave, decode_on_ranks, case)
    assert results[0] == _reference(case)
    assert all(r is not None and all(d is None for *_, d in r) for r in results[1:]), "only rank 0 reports digests"
    assert all([t for t, *_ in r] == [t for t, *_ in results[0]] for r in results), "every rank emits the same tokens"


def test_a_rank_holds_only_its_share_of_the_blocks():
    config = ModelConfig.build(kpool=4, num_spec=3)
    block = config.cache.block_size
    length = 10 * block + 5
    shards = DcpConfig.for_cache(config.cache, size=4).shards()
    held = [s.blocks_for_tokens(config.cache, length) for s in shards]
    assert held == [3, 3, 3, 2]  # 11 blocks dealt over 4 ranks, whole blocks each
    assert sum(held) == config.cache.blocks_for_tokens(length)


def test_every_rank_reserves_the_most_any_rank_needs_and_one_rank_reserves_the_whole_request():
    cache = ModelConfig.build(kpool=4, num_spec=3).cache
    block = cache.block_size
    four = DcpConfig.for_cache(cache, size=4)
    # 10 blocks and 5 tokens, plus 8 outputs less the unwritten last: 11 blocks, dealt 3, 3, 3, 2
    assert four.rank_blocks_for_request(cache, 10 * block + 5, 8) == 3
    assert four.rank_blocks_for_request(cache, 4 * block, 1) == 1  # one whole block each
    assert four.rank_blocks_for_request(cache, 4 * block, 2) == 2  # rank 0 takes the fifth block's first token
    one = DcpConfig.for_cache(cache, size=1)
    for prompt_len, max_tokens in [(1, 1), (block, 1), (block, 2), (10 * block + 5, 8)]:
        assert one.rank_blocks_for_request(cache, prompt_len, max_tokens) == cache.blocks_for_request(prompt_len, max_tokens)
    with pytest.raises(ValueError, match="writes -1 positions"):
        four.rank_blocks_for_request(cache, 0, 0)


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 5), interleave=st.integers(1, 9), end=st.integers(0, 200), start=st.integers(0, 200))
def test_every_position_has_one_owner_and_a_dense_local_place(size, interleave, end, start):
    shards = [DcpShard(size=size, rank=r, interleave=interleave) for r in range(size)]
    for shard in shards:
        mine = [p for p in range(end) if shard.owns(p)]
        assert [shard.local_position(p) for p in mine] == list(range(len(mine)))
        assert [shard.global_position(i) for i in range(len(mine))] == mine
        assert shard.owned_tokens(end) == len(mine)
        assert shard.owned_tokens(torch.tensor([end])).tolist() == [len(mine)]
        runs = shard.owned_runs(min(start, end), end)
        assert [p for first, n in runs for p in range(first, first + n)] == [p for p in mine if p >= min(start, end)]
    assert sum(s.owned_tokens(end) for s in shards) == end


@settings(max_examples=60, deadline=None)
@given(ranks=st.integers(1, 4), pools=st.integers(0, 60), topk=st.integers(1, 12), levels=st.integers(1, 6),
       interleave_pools=st.integers(1, 5), seed=st.integers(0, 1000))
def test_the_union_of_per_rank_top_k_is_the_global_top_k(ranks, pools, topk, levels, interleave_pools, seed):
    """Scores with many ties (few distinct values): the merge keeps the lower pool index on a tie,
    as the single-rank top-k does."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, levels, (2, pools), generator=gen).to(torch.float32)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :topk]
    expected = torch.full((2, topk), -1, dtype=torch.int64)
    expected[:, :order.shape[1]] = order
    per_rank_pools, per_rank_scores = [], []
    for rank in range(ranks):
        shard = DcpShard(size=ranks, rank=rank, interleave=interleave_pools)
        mine = torch.tensor([p for p in range(pools) if shard.owns(p)], dtype=torch.int64)
        local = scores[:, mine] if mine.numel() else scores[:, :0]
        best = torch.sort(local, dim=1, descending=True, stable=True).indices[:, :topk]
        top = torch.full((2, topk), -1, dtype=torch.int64)
        top_scores = torch.full((2, topk), float("-inf"))
        top[:, :best.shape[1]] = mine[best] if mine.numel() else best
        top_scores[:, :best.shape[1]] = torch.gather(local, 1, best)
        per_rank_pools.append(top)
        per_rank_scores.append(top_scores)
    merged = merge_topk(torch.stack(per_rank_pools), torch.stack(per_rank_scores), topk)
    assert torch.equal(merged, expected)


def test_a_pool_score_does_not_depend_on_the_other_pools_scored():
    """The reference scores pools one by one in effect: scoring a subset gives the same bits."""
    from kpool_pd.kernels.kpool_cache import kpool_write_entries
    gen = torch.Generator().manual_seed(3)
    states, blocks = 16, 6
    index_q = torch.zeros(blocks, 1, states, 128, dtype=torch.float8_e4m3fn)  # one kernel page a block
    index_scale = torch.zeros(blocks, 1, states)
    count = blocks * states
    kpool_write_entries(index_q, index_scale, torch.randn(count, 128, generator=gen).to(torch.float8_e4m3fn),
                        torch.rand(count, generator=gen) + 0.5, torch.arange(count))
    q = torch.randn(1, 4, 128, generator=gen).to(torch.bfloat16)
    weights = torch.rand(1, 4, generator=gen)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    kpool = 4
    _, full = kpool_indexer_topk(q, weights, torch.tensor([count * kpool]), table, index_q, index_scale,
                                 kpool=kpool, topk=count)
    pools, _ = kpool_indexer_topk(q, weights, torch.tensor([count * kpool]), table, index_q, index_scale,
                                  kpool=kpool, topk=count)
    for keep in (1, 2, 3):
        sub = table.clone()
        sub[0, keep:] = -1
        sub_pools, sub_scores = kpool_indexer_topk(q, weights, torch.tensor([count * kpool]), sub, index_q,
                                                   index_scale, kpool=kpool, topk=count)
        held = sub_pools[0] >= 0
        where = {int(p): i for i, p in enumerate(pools[0])}
        assert held.sum() == keep * states
        for p, s in zip(sub_pools[0][held].tolist(), sub_scores[0][held]):
            assert s.view(torch.int32) == full[0, where[p]].view(torch.int32)


def test_qsa_refuses_dcp_naming_it():
    config = ModelConfig.build(family=CacheFamily.QSA, compress_ratio=4)
    with pytest.raises(ValueError, match=r"decode-context parallel \(DCP\).*got 2"):
        DcpConfig.for_cache(config.cache, size=2)
    assert DcpConfig.for_cache(config.cache, size=1).size == 1


def test_an_interleave_off_the_pool_is_refused():
    config = ModelConfig.build(kpool=4)
    with pytest.raises(ValueError, match=r"interleave \(6 tokens\) must be a multiple of kpool \(4\)"):
        DcpConfig.for_cache(config.cache, size=2, interleave=6)
    assert DcpConfig.for_cache(config.cache, size=2).interleave == config.cache.block_size


def test_ranks_join_over_nccl_on_gpus_and_gloo_on_the_cpu():
    assert backend_for("cuda:1") == backend_for(torch.device("cuda", 0)) == "nccl"
    assert backend_for("cpu") == "gloo"
