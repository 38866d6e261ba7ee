"""QSA top-k selection (kernels.qsa_score)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kpool_pd.kernels.qsa_score import qsa_topk
from kpool_pd.kvcache import BlockLayout, BlockOrder, CacheConfig, CacheDtype, CacheFamily, CachePool


def make_cache(*, r, block_size, heads, head_size, dtype, order, num_blocks):
    config = CacheConfig(
        family=CacheFamily.QSA, block_size=block_size, compress_ratio=r, qsa_head_size=head_size,
        qsa_num_heads=heads, qsa_dtype=dtype, order=order, mla_entry_bytes=8, cache_rope_positions=False,
    )
    pool = CachePool(BlockLayout(config), num_blocks=num_blocks, num_rings=1)
    cache = pool.qsa_keys(0)
    cache.copy_(torch.full(cache.shape, float("nan")).to(cache.dtype))  # poison: unwritten rows are NaN
    return cache


def brute_force(q, keys, seq_lens, r, topk):
    """keys[b][j]: the request's row j as nested lists. Exact integer scores (the sqrt(D) scale keeps order)."""
    heads_q = len(q[0])
    rows_out, tokens_out = [], []
    for b, seq_len in enumerate(seq_lens):
        visible = seq_len // r
        group = heads_q // len(keys[b][0]) if visible else 1
        scores = []
        for j in range(visible):
            total = 0
            for h in range(heads_q):
                total += max(0, sum(x * y for x, y in zip(q[b][h], keys[b][j][h // group])))
            scores.append((-total, j))
        chosen = [j for _, j in sorted(scores)[:topk]]
        tokens = [j * r + i for j in chosen for i in range(r)] + list(range(visible * r, seq_len))
        width = topk * r + r - 1
        rows_out.append(chosen + [-1] * (topk - len(chosen)))
        tokens_out.append(tokens + [-1] * (width - len(tokens)))
    return rows_out, tokens_out


@st.composite
def problems(draw):
    r = draw(st.sampled_from([1, 2, 4]))
    block_size = r * draw(st.sampled_from([1, 2, 4]))
    heads = draw(st.sampled_from([1, 2]))
    heads_q = heads * draw(st.sampled_from([1, 2]))
    num_queries = draw(st.integers(1, 4))
    seq_lens = [draw(st.one_of(st.integers(0, 3 * r), st.integers(0, 40))) for _ in range(num_queries)]
    topk = draw(st.integers(1, 6))
    return r, block_size, heads, heads_q, seq_lens, topk


DTYPES = [CacheDtype.BFLOAT16, CacheDtype.FP8_E4M3]
ORDERS = [BlockOrder.BLNHC, BlockOrder.BLHNC]


@settings(max_examples=40, deadline=None)
@given(problem=problems(), dtype=st.sampled_from(DTYPES), order=st.sampled_from(ORDERS), seed=st.integers(0, 2 ** 31))
def test_matches_brute_force(problem, dtype, order, seed):
    r, block_size, heads, heads_q, seq_lens, topk = problem
    head_size = 64
    gen = torch.Generator().manual_seed(seed)
    blocks_per_query = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_query) + 1
    cache = make_cache(r=r, block_size=block_size, heads=heads, head_size=head_size, dtype=dtype, order=order,
                       num_blocks=num_blocks)
    # Scattered block ids; the table is padded with -1 or with garbage ids that must not be read.
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_query) + 1
    table, keys = [], []
    for b, (n, seq_len) in enumerate(zip(blocks_per_query, seq_lens)):
        mine, ids = ids[:n], ids[n:]
        table.append(mine + [-1 if b % 2 else 2 ** 30] * (width - n))
        rows = []
        for j in range(seq_len // r):
            # Small integers: exact in bf16 and fp8, exact dot products, and many ties.
            row = torch.randint(-2, 3, (heads, head_size), generator=gen).float()
            cache[mine[j * r // block_size], j % (block_size // r)] = row.to(cache.dtype)
            rows.append(row.int().tolist())
        keys.append(rows)
    q = torch.randint(-2, 3, (len(seq_lens), heads_q, head_size), generator=gen).to(torch.bfloat16)
    rows, tokens = qsa_topk(
        q, cache, torch.tensor(table, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
        compress_ratio=r, block_size=block_size, topk=topk,
    )
    want_rows, want_tokens = brute_force(q.int().tolist(), keys, seq_lens, r, topk)
    assert rows.dtype == tokens.dtype == torch.int64
    assert rows.tolist() == want_rows
    assert tokens.tolist() == want_tokens


def test_hand_example_and_format():
    # r = 4, one kv head, D = 2; 10 tokens: rows 0 and 1 are complete, tokens 8, 9 are the open group.
    cache = torch.zeros(2, 2, 1, 2, dtype=torch.bfloat16)  # block_size 8: 2 rows a block
    cache[1, 0, 0] = torch.tensor([1.0, 0.0])  # row 0 (block 1): q . k = 2
    cache[1, 1, 0] = torch.tensor([3.0, 1.0])  # row 1: q . k = 6 + 1 = 7
    cache[0, 0, 0] = float("nan")  # block 0 holds nothing of this request
    q = torch.tensor([[[2.0, 1.0]]], dtype=torch.bfloat16)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([10], dtype=torch.int32)
    rows, tokens = qsa_topk(q, cache, table, seq_lens, compress_ratio=4, block_size=8, topk=3)
    assert rows.tolist() == [[1, 0, -1]]
    assert tokens.tolist() == [[4, 5, 6, 7, 0, 1, 2, 3, 8, 9, -1, -1, -1, -1, -1]]
    rows, tokens = qsa_topk(q, cache, table, seq_lens, compress_ratio=4, block_size=8, topk=1)
    assert rows.tolist() == [[1]] and tokens.tolist() == [[4, 5, 6, 7, 8, 9, -1]]


def test_relu_per_head_and_grouped_queries():
    # Two kv heads, four query heads: heads 0, 1 read kv head 0; heads 2, 3 read kv head 1.
    cache = torch.zeros(1, 2, 2, 2, dtype=torch.bfloat16)
    cache[0, 0] = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # row 0
    cache[0, 1] = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # row 1
    # Row 0: heads (5, -5, 1, 1) -> relu sum 7. Row 1: heads (1, 1, -5, 5) -> relu sum 7; tie -> row 0 first.
    q = torch.tensor([[[5.0, 1.0], [-5.0, 1.0], [-5.0, 1.0], [5.0, 1.0]]], dtype=torch.bfloat16)
    rows, _ = qsa_topk(q, cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
                       compress_ratio=2, block_size=4, topk=2)
    assert rows.tolist() == [[0, 1]]
    q[0, 3, 1] = 2.0  # row 0 gains 1 on head 3
    rows, _ = qsa_topk(q, cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
                       compress_ratio=2, block_size=4, topk=1)
    assert rows.tolist() == [[0]]


@pytest.mark.parametrize(
    "seq_len, r, expected_tokens",
    [(0, 4, [-1] * 7), (1, 4, [0] + [-1] * 6), (3, 4, [0, 1, 2] + [-1] * 4), (1, 1, [0]),
     (4, 4, [0, 1, 2, 3, -1, -1, -1])],
    ids=["empty", "single-token", "open-group-only", "r1-single-token", "exactly-one-group"],
)
def test_edge_lengths(seq_len, r, expected_tokens):
    cache = torch.ones(1, 1, 1, 4, dtype=torch.bfloat16)
    rows, tokens = qsa_topk(
        torch.ones(1, 1, 4, dtype=torch.bfloat16), cache, torch.tensor([[0] * 4], dtype=torch.int32),
        torch.tensor([seq_len], dtype=torch.int32), compress_ratio=r, block_size=r, topk=1,
    )
    assert tokens.tolist() == [expected_tokens]


GOOD = {
    "q": torch.zeros(2, 4, 8, dtype=torch.bfloat16),
    "cache": torch.zeros(3, 2, 2, 8, dtype=torch.bfloat16),
    "table": torch.tensor([[0, 1], [2, -1]], dtype=torch.int32),
    "seq": torch.tensor([8, 3], dtype=torch.int32),
}


@pytest.mark.parametrize(
    "change, params, match",
    [
        ({"q": torch.zeros(2, 3, 8, dtype=torch.bfloat16)}, {},
         "Hq = 3 is not a multiple of the cache's kv heads H = 2"),
        ({"q": torch.zeros(2, 4, 8)}, {}, "q must be bf16"),
        ({"cache": torch.zeros(3, 2, 2, 4, dtype=torch.bfloat16)}, {}, "D=8"),
        ({"cache": torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16)}, {}, "rows=2"),
        ({"seq": torch.tensor([8.0, 3.0])}, {}, "seq_lens must be int32 or int64"),
        ({"seq": torch.tensor([8, 9], dtype=torch.int32)}, {}, r"query 1: seq_len 9 must be in \[0, 8\]"),
        ({"table": torch.tensor([[0, 1], [5, -1]], dtype=torch.int32)}, {}, "block 5, outside the cache's blocks"),
        ({"table": torch.tensor([[0, -1], [2, -1]], dtype=torch.int32)}, {}, "query 0: visible row 2 .* block -1"),
        ({}, {"topk": 0}, "topk must be a positive integer, got 0"),
        ({}, {"block_size": 6}, "block_size 6 is not a multiple of compress_ratio 4"),
    ],
    ids=["head-groups", "fp32-q", "head-size", "rows-per-block", "float-seq", "seq-past-table", "block-past-cache",
         "negative-block-visible", "topk-zero", "block-not-multiple-of-r"],
)
def test_rejects_bad_inputs(change, params, match):
    args = GOOD | change
    kwargs = {"compress_ratio": 2, "block_size": 4, "topk": 2} | params
    if "block_size" in params:
        kwargs["compress_ratio"] = 4
    with pytest.raises(ValueError, match=match):
        qsa_topk(args["q"], args["cache"], args["table"], args["seq"], **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.value)
def test_cuda_matches_cpu(dtype):
    # Integer-valued rows and queries: exact scores on both devices, so the choice is identical.
    gen = torch.Generator().manual_seed(0)
    cache = make_cache(r=4, block_size=16, heads=2, head_size=64, dtype=dtype, order=BlockOrder.BLHNC, num_blocks=6)
    cache.copy_(torch.randint(-2, 3, cache.shape, generator=gen).to(cache.dtype))
    q = torch.randint(-2, 3, (3, 4, 64), generator=gen).to(torch.bfloat16)
    table = torch.tensor([[0, 1, 2], [3, 4, -1], [5, -1, -1]], dtype=torch.int32)
    seq_lens = torch.tensor([45, 30, 3], dtype=torch.int32)
    kwargs = {"compress_ratio": 4, "block_size": 16, "topk": 4}
    cpu = qsa_topk(q, cache, table, seq_lens, **kwargs)
    gpu = qsa_topk(q.cuda(), cache.cuda(), table.cuda(), seq_lens.cuda(), **kwargs)
    assert all(g.is_cuda for g in gpu)
    assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])
