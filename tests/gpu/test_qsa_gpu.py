"""The QSA Triton kernels and the block repack compiled on a CUDA device, against the torch references.

Comparison rules (see also tests/test_qsa_triton.py for the interpreter):
- ring writes, the metadata builder, the block repack, and every ring byte of a forward update:
  identical (integer and byte moves only);
- compressed rows against the reference run on the same CUDA tensors: identical (the kernels do the
  reference's fp32 operations in its order; cos/sin are libdevice's cosf/sinf, which torch's CUDA
  cos/sin also call); against the reference on CPU tensors: ``rows_within_rule`` (CUDA's cosf/sinf
  and torch's CPU ones can differ by an ulp);
- the QSA PD invariant on CUDA tensors: a prefill of the whole sequence and chunked prefill plus
  drafted decode steps give byte-identical compressed rows and open groups;
- scoring: integer-valued inputs give identical rows and token indices; random ones scores within
  1e-5 relative (fp32 accumulation order of the matrix unit), the same rows except near-ties;
- garbage (NaN / inf) keys: NaN exactly where the reference has NaN (NaN bits are not specified),
  every other byte identical;
- the metadata builder and the forward update never synchronise with the host and replay from a
  CUDA graph with the reference's results.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kernels import build_qsa_metadata, compress_group_keys, qsa_forward_update, qsa_topk, repack_blocks, \
    write_qsa_ring
from kernels.block_repack import ref as repack_ref
from kernels.qsa_compress import ref as compress_ref
from kernels.qsa_metadata import ref as metadata_ref
from kernels.qsa_ring import ref as ring_ref
from kernels.qsa_score import ref as score_ref
from kernels.qsa_score.triton import qsa_scores_triton
from kernels.qsa_update import ref as update_ref
from kvcache import BlockLayout, BlockOrder, CacheConfig, CacheDtype, CacheFamily, CachePool, qsa_ring_capacity
from tests.test_qsa_triton import ROPE, assert_same_or_both_nan, rows_within_rule
from tests.test_qsa_update import EDGE_HISTORIES, Storage, make_history, norm_weight, run_both, state_mismatches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device: run tests/gpu/run_all.sh on the H200 through the device tool"),
]


def _poison(t: torch.Tensor, seed: int) -> None:
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", [(1, 4, 1, 128), (4099, 4, 2, 128), (257, 3, 1, 96), (64, 1, 8, 128)],
                         ids=lambda s: "G{}-r{}-H{}-D{}".format(*s))
def test_compress_matches_reference(shape, out_dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    keys = (torch.randn(*shape, generator=gen) * 3).to(torch.bfloat16)
    positions = torch.randint(0, 2 ** 40, (shape[0], 3), generator=gen)
    weight = torch.randn(shape[3], generator=gen) * 0.5
    args = (keys.cuda(), positions.cuda(), weight.cuda())
    got = compress_group_keys(*args, eps=1e-6, out_dtype=out_dtype, **ROPE)
    want = compress_ref.compress_group_keys(*args, eps=1e-6, out_dtype=out_dtype, **ROPE)
    assert _same(got, want), f"{int((got.view(torch.uint8) != want.view(torch.uint8)).sum())} bytes differ"
    cpu = compress_ref.compress_group_keys(keys, positions, weight, eps=1e-6, out_dtype=out_dtype, **ROPE)
    print(f"compress {shape}: {rows_within_rule(got.cpu(), cpu)} elements differ from the CPU reference")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_compress_nan_and_inf_keys_match_the_cuda_reference(out_dtype):
    # Garbage keys (rejected drafts) reach compressed rows past the committed length: NaN where the
    # reference has NaN (NaN bits are not specified), every other byte identical.
    gen = torch.Generator().manual_seed(4)
    bits = torch.randint(-2 ** 15, 2 ** 15, (64, 4, 2, 128), generator=gen, dtype=torch.int16)
    keys = bits.view(torch.bfloat16).cuda()
    positions = torch.randint(0, 2 ** 40, (64, 3), generator=gen).cuda()
    weight = torch.randn(128, generator=gen).cuda()
    got = compress_group_keys(keys, positions, weight, eps=1e-6, out_dtype=out_dtype, **ROPE)
    want = compress_ref.compress_group_keys(keys, positions, weight, eps=1e-6, out_dtype=out_dtype, **ROPE)
    assert_same_or_both_nan(got.cpu(), want.cpu())


@pytest.mark.parametrize("rope", [True, False], ids=["packed-positions", "keys-only"])
def test_ring_write_matches_reference(rope):
    gen = torch.Generator().manual_seed(1)
    rings, cap, heads = 64, 8, 2
    width = 140 if rope else 128
    got = torch.empty(rings, cap, heads, width, dtype=torch.bfloat16, device="cuda")
    _poison(got, 2)
    want = got.clone()
    tokens = 300
    keys = torch.randint(-2 ** 15, 2 ** 15, (tokens, heads, 128), generator=gen, dtype=torch.int16)
    keys = keys.view(torch.bfloat16).cuda()
    positions = torch.randint(-2 ** 62, 2 ** 62, (tokens, 3), generator=gen).cuda() if rope else None
    slots = torch.randperm(rings * cap, generator=gen)[:tokens]
    slots[::7] = -1
    slots = slots.cuda()
    write_qsa_ring(got, keys, positions, slots)
    ring_ref.write_qsa_ring(want, keys, positions, slots)
    assert _same(got, want)


def _metadata_inputs(requests: int, seed: int, *, block_size: int = 64, max_len: int = 4096, max_q: int = 64):
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, max_len, (requests,), generator=gen)
    q_lens = torch.minimum(torch.randint(0, max_q, (requests,), generator=gen), seq)
    q_lens[::5] = 1  # decode steps
    q_lens[3::11] = 0  # idle requests
    cols = -(-max_len // block_size)
    table = torch.randperm(requests * cols, generator=gen).view(requests, cols).to(torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    rings = torch.randperm(requests, generator=gen).to(torch.int32)
    return [t.cuda() for t in (starts, seq.to(torch.int32), table, rings)], int(q_lens.sum())


FIELDS = ("token_to_req", "logical_positions", "visible_blocks", "ring_slot_mapping", "compressed_slot_mapping",
          "k_work", "num_work")


@pytest.mark.parametrize("r, cap", [(4, 8), (1, 4), (3, 6), (8, 16)], ids=lambda v: str(v))
def test_metadata_matches_reference(r, cap):
    args, tokens = _metadata_inputs(300, r, block_size=48 if r == 3 else 64)
    params = {"compress_ratio": r, "ring_capacity": cap, "block_size": 48 if r == 3 else 64}
    got = build_qsa_metadata(*args, **params, num_tokens=tokens)
    want = metadata_ref.build_qsa_metadata(*args, **params)
    for name in FIELDS:
        assert getattr(got, name).is_cuda and torch.equal(getattr(got, name), getattr(want, name)), name


def test_metadata_never_syncs_and_replays_from_a_graph():
    args, tokens = _metadata_inputs(256, 7)
    params = {"compress_ratio": 4, "ring_capacity": 8, "block_size": 64}
    build_qsa_metadata(*args, **params, num_tokens=tokens)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        build_qsa_metadata(*args, **params, num_tokens=tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = build_qsa_metadata(*args, **params, num_tokens=tokens)
    gen = torch.Generator().manual_seed(8)
    args[1].copy_(torch.clamp(args[1].cpu() + torch.randint(0, 50, (256,), generator=gen), max=4095))  # new lengths
    args[2].copy_(args[2][torch.randperm(256, generator=gen).cuda()])  # new tables
    graph.replay()
    torch.cuda.synchronize()
    want = metadata_ref.build_qsa_metadata(*args, **params)
    for name in ("token_to_req", "logical_positions", "visible_blocks", "ring_slot_mapping",
                 "compressed_slot_mapping"):
        assert torch.equal(getattr(captured, name), getattr(want, name)), name
    assert torch.equal(captured.num_work, want.num_work)
    num_work = int(want.num_work)
    assert torch.equal(captured.k_work[:num_work], want.k_work[:num_work])
    assert bool((captured.k_work[num_work:] == -1).all())


def _qsa_pool(dtype: CacheDtype, order: BlockOrder, heads: int, r: int, num_spec: int, blocks: int, rings: int,
              seed: int) -> CachePool:
    cap = qsa_ring_capacity(r, num_spec)
    config = CacheConfig(family=CacheFamily.QSA, layer_names=("l0", "l1"), block_size=math.lcm(r, cap, 64),
                         num_spec=num_spec, mla_entry_bytes=16, order=order, compress_ratio=r, qsa_num_heads=heads,
                         qsa_dtype=dtype)
    pool = CachePool(BlockLayout(config), num_blocks=blocks, num_rings=rings, device="cuda")
    _poison(pool.blocks, seed)
    _poison(pool.rings, seed + 1)
    return pool


def _forwards(requests: int, steps: list[tuple[int, int]], gen: torch.Generator) -> list[list[int]]:
    """q_lens per forward: a prefill of random lengths, then (q_len range) steps."""
    plans = [torch.randint(1, 700, (requests,), generator=gen).tolist()]
    for low, high in steps:
        plans.append(torch.randint(low, high, (requests,), generator=gen).tolist())
    return plans


@pytest.mark.parametrize(
    "dtype, order, heads, rope",
    [(CacheDtype.BFLOAT16, BlockOrder.BLNHC, 1, True), (CacheDtype.FP8_E4M3, BlockOrder.BLHNC, 2, True),
     (CacheDtype.BFLOAT16, BlockOrder.BLHNC, 4, False)],
    ids=["bf16-BLNHC-rope-cached", "fp8-BLHNC-2heads-rope-cached", "bf16-BLHNC-4heads-text-rope"],
)
def test_forward_update_matches_reference(dtype, order, heads, rope):
    r, num_spec, requests = 4, 3, 24
    blocks = requests * 24
    got_pool = _qsa_pool(dtype, order, heads, r, num_spec, blocks, requests, 5)
    want_pool = _qsa_pool(dtype, order, heads, r, num_spec, blocks, requests, 5)
    cap, block_size = got_pool.config.qsa_ring.capacity, got_pool.config.block_size
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(128, generator=gen) * 0.5).cuda()
    table = torch.randperm(blocks, generator=gen).view(requests, 24).to(torch.int32).cuda()
    rings = torch.randperm(requests, generator=gen).to(torch.int32).cuda()
    lengths = [0] * requests
    spec = got_pool.config.qsa_keys
    kwargs = {"compress_ratio": r, "block_size": block_size, "eps": spec.norm_eps, "cache_rope_positions": rope,
              **ROPE}
    for q_lens in _forwards(requests, [(1, 300), (0, 5), (0, 5), (1, 2)], gen):
        seq = [length + q for length, q in zip(lengths, q_lens)]
        starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).cuda()
        meta = build_qsa_metadata(starts, torch.tensor(seq, dtype=torch.int32).cuda(), table, rings,
                                  compress_ratio=r, ring_capacity=cap, block_size=block_size, num_tokens=sum(q_lens))
        keys = (torch.randn(sum(q_lens), heads, 128, generator=gen) * 2).to(torch.bfloat16).cuda()
        positions = torch.randint(0, 2 ** 33, (sum(q_lens), 3), generator=gen).cuda()
        qsa_forward_update(keys, positions, meta, got_pool.qsa_ring("l1"), got_pool.qsa_keys("l1"), weight, **kwargs)
        update_ref.qsa_forward_update(keys, positions, meta, want_pool.qsa_ring("l1"), want_pool.qsa_keys("l1"),
                                      weight, **kwargs)
        lengths = seq
    assert torch.equal(got_pool.rings, want_pool.rings)
    assert torch.equal(got_pool.blocks, want_pool.blocks)


def test_forward_update_never_syncs_and_replays_from_a_graph():
    r, num_spec, requests, heads = 4, 3, 64, 1
    pool = _qsa_pool(CacheDtype.BFLOAT16, BlockOrder.BLNHC, heads, r, num_spec, requests * 4, requests, 1)
    ref_pool = _qsa_pool(CacheDtype.BFLOAT16, BlockOrder.BLNHC, heads, r, num_spec, requests * 4, requests, 1)
    cap, block_size = pool.config.qsa_ring.capacity, pool.config.block_size
    gen = torch.Generator().manual_seed(3)
    table = torch.randperm(requests * 4, generator=gen).view(requests, 4).to(torch.int32).cuda()
    seq = torch.randint(8, 200, (requests,), generator=gen).to(torch.int32).cuda()
    starts = torch.arange(0, 4 * requests + 1, 4, dtype=torch.int32).cuda()
    rings = torch.arange(requests, dtype=torch.int32).cuda()
    weight = torch.randn(128, generator=gen).cuda()
    kwargs = {"compress_ratio": r, "block_size": block_size, "eps": 1e-6, "cache_rope_positions": True, **ROPE}
    # the straddling groups' older keys come from the rings: finite keys, small positions
    pool.rings.view(torch.bfloat16).copy_(torch.randn(requests, pool.rings.shape[1] // 2, generator=gen))
    pool.qsa_ring(0)[..., 128:].view(torch.int64).copy_(torch.randint(0, 2 ** 20, (requests, cap, 1, 3)))
    ref_pool.rings.copy_(pool.rings)
    keys = torch.randn(4 * requests, heads, 128, generator=gen).to(torch.bfloat16).cuda()
    positions = torch.randint(0, 2 ** 20, (4 * requests, 3), generator=gen).cuda()

    def step() -> None:
        meta = build_qsa_metadata(starts, seq, table, rings, compress_ratio=r, ring_capacity=cap,
                                  block_size=block_size, num_tokens=4 * requests)
        qsa_forward_update(keys, positions, meta, pool.qsa_ring(0), pool.qsa_keys(0), weight, **kwargs)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    first_keys = keys.clone()
    keys.copy_(torch.randn(4 * requests, heads, 128, generator=gen).to(torch.bfloat16))
    graph.replay()
    meta = metadata_ref.build_qsa_metadata(starts, seq, table, rings, compress_ratio=r, ring_capacity=cap,
                                           block_size=block_size)
    for step_keys in (first_keys, first_keys, keys):
        update_ref.qsa_forward_update(step_keys, positions, meta, ref_pool.qsa_ring(0), ref_pool.qsa_keys(0), weight,
                                      **kwargs)
    assert torch.equal(pool.rings, ref_pool.rings)
    assert torch.equal(pool.blocks, ref_pool.blocks)


# --- the QSA PD invariant on CUDA tensors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "storage_kind",
    [{"rope": True}, {"rope": False}, {"rope": True, "dtype": CacheDtype.FP8_E4M3, "order": BlockOrder.BLHNC,
                                       "heads": 2}],
    ids=["bf16-BLNHC-rope-cached", "bf16-BLNHC-text-rope", "fp8-BLHNC-2heads-rope-cached"],
)
@pytest.mark.parametrize("case", list(EDGE_HISTORIES), ids=list(EDGE_HISTORIES))
def test_pd_invariant_edge_histories_on_cuda(case, storage_kind):
    r, num_spec, plans = EDGE_HISTORIES[case]
    storage = Storage(r=r, num_spec=num_spec, **storage_kind)
    gen = torch.Generator().manual_seed(7)
    histories = [make_history(chunks, steps, storage, gen) for chunks, steps in plans]
    weight = norm_weight(7)
    whole, stepped = run_both(storage, histories, weight, device="cuda")
    assert state_mismatches(whole, histories, weight) == []
    assert state_mismatches(stepped, histories, weight) == []


@pytest.mark.parametrize("r", [1, 2, 4, 8], ids=lambda r: f"r{r}")
@pytest.mark.parametrize("num_spec", [0, 1, 3, 7], ids=lambda n: f"spec{n}")
def test_pd_invariant_random_histories_on_cuda(r, num_spec):
    storage = Storage(r=r, num_spec=num_spec, rope=True, dtype=CacheDtype.FP8_E4M3, order=BlockOrder.BLHNC, heads=2)
    gen = torch.Generator().manual_seed(r * 10 + num_spec)
    histories = []
    for _ in range(4):
        chunks = torch.randint(1, 40, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen).tolist()
        steps = []
        for _ in range(12):
            drafts = int(torch.randint(0, num_spec + 1, (1,), generator=gen))
            steps.append((drafts, int(torch.randint(0, drafts + 1, (1,), generator=gen))))
        histories.append(make_history(chunks, steps, storage, gen))
    weight = norm_weight(r)
    whole, stepped = run_both(storage, histories, weight, device="cuda")
    assert state_mismatches(whole, histories, weight) == []
    assert state_mismatches(stepped, histories, weight) == []


# --- scoring + top-k ------------------------------------------------------------------------------------------


def _score_inputs(dtype: CacheDtype, integer: bool, seed: int, queries: int = 48, q_heads: int = 16):
    gen = torch.Generator().manual_seed(seed)
    r, block_size, kv_heads, head_size, blocks = 4, 64, 2, 128, 400
    cache = torch.empty(blocks, kv_heads, block_size // r, head_size, dtype=dtype.torch_dtype).permute(0, 2, 1, 3)
    values = torch.randint(-3, 4, cache.shape, generator=gen) if integer else torch.randn(cache.shape, generator=gen)
    cache.copy_(values.to(cache.dtype))
    q = (torch.randint(-3, 4, (queries, q_heads, head_size), generator=gen) if integer
         else torch.randn(queries, q_heads, head_size, generator=gen)).to(torch.bfloat16)
    table = torch.randperm(blocks, generator=gen)[:queries * 8].view(queries, 8).to(torch.int32)
    seq_lens = torch.randint(0, 8 * block_size + 1, (queries,), generator=gen).to(torch.int32)
    return q.cuda(), cache.cuda(), table.cuda(), seq_lens.cuda(), {"compress_ratio": r, "block_size": block_size}


@pytest.mark.parametrize("dtype", [CacheDtype.BFLOAT16, CacheDtype.FP8_E4M3], ids=lambda d: d.value)
@pytest.mark.parametrize("topk", [1, 16, 200], ids=lambda k: f"top{k}")
def test_topk_exact_on_integer_values(dtype, topk):
    q, cache, table, seq_lens, params = _score_inputs(dtype, True, 1)
    got = qsa_topk(q, cache, table, seq_lens, **params, topk=topk)
    want = score_ref.qsa_topk(q.cpu(), cache.cpu(), table.cpu(), seq_lens.cpu(), **params, topk=topk)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("dtype", [CacheDtype.BFLOAT16, CacheDtype.FP8_E4M3], ids=lambda d: d.value)
def test_scores_within_accumulation_error(dtype):
    q, cache, table, seq_lens, params = _score_inputs(dtype, False, 2)
    scores = qsa_scores_triton(q, cache, table, seq_lens, **params).cpu()
    q, cache, table, seq_lens = q.cpu(), cache.cpu(), table.cpu(), seq_lens.cpu()
    rows, _ = qsa_topk(q.cuda(), cache.cuda(), table.cuda(), seq_lens.cuda(), **params, topk=32)
    want_rows, _ = score_ref.qsa_topk(q, cache, table, seq_lens, **params, topk=32)
    rows = rows.cpu()
    assert torch.equal(rows < 0, want_rows < 0)
    for b, visible in enumerate((seq_lens // 4).tolist()):
        j = torch.arange(visible)
        k = cache[table[b, j * 4 // 64].long(), j % 16].float().repeat_interleave(8, dim=1)  # [J, Hq, D]
        want = torch.relu((q[b].float()[None] * k).sum(-1)).sum(-1) / math.sqrt(128)
        assert bool(((scores[b, :visible] - want).abs() <= 1e-5 * want.abs().clamp_min(1.0)).all())
        for i in torch.nonzero(rows[b] != want_rows[b]).flatten().tolist():  # only a near-tie may swap
            a, c = float(scores[b, rows[b, i]]), float(scores[b, want_rows[b, i]])
            assert abs(a - c) <= 2e-5 * max(1.0, abs(c))


# --- block repack ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", [CacheFamily.QSA, CacheFamily.KPOOL], ids=lambda f: f.value)
@pytest.mark.parametrize("orders", [(BlockOrder.BLNHC, BlockOrder.BLHNC), (BlockOrder.BLHNC, BlockOrder.BLNHC),
                                    (BlockOrder.BLNHC, BlockOrder.BLNHC)], ids=lambda o: f"{o[0].value}-{o[1].value}")
def test_repack_matches_reference_and_views(family, orders):
    base = CacheConfig(family=family, layer_names=tuple(f"l{i}" for i in range(5)), block_size=64,
                       mla_num_heads=4, qsa_num_heads=4, mla_entry_bytes=656)
    src = CachePool(BlockLayout(dataclasses.replace(base, order=orders[0])), num_blocks=40, num_rings=1, device="cuda")
    got = CachePool(BlockLayout(dataclasses.replace(base, order=orders[1])), num_blocks=50, num_rings=1, device="cuda")
    want = CachePool(got.layout, num_blocks=50, num_rings=1, device="cuda")
    _poison(src.blocks, 1)
    _poison(got.blocks, 2)
    want.blocks.copy_(got.blocks)
    gen = torch.Generator().manual_seed(3)
    src_ids = torch.randperm(40, generator=gen)[:33].cuda()
    dst_ids = torch.randperm(50, generator=gen)[:33].cuda()
    repack_blocks(src.blocks, src.layout, src_ids, got.blocks, got.layout, dst_ids)
    repack_ref.repack_blocks(src.blocks, src.layout, src_ids, want.blocks, want.layout, dst_ids)
    assert torch.equal(got.blocks, want.blocks)
    for layer in range(5):
        assert torch.equal(got.mla(layer)[dst_ids], src.mla(layer)[src_ids])
        if family is CacheFamily.QSA:
            assert _same(got.qsa_keys(layer)[dst_ids], src.qsa_keys(layer)[src_ids])
