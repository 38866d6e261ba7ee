"""The QSA Triton kernels in Triton's CPU interpreter, against the torch references.

Comparison rules in the interpreter:
- ring writes, the metadata builder, and every ring byte of a forward update: identical (integer
  and byte moves only);
- compressed rows (compress, forward update): the kernels do the reference's fp32 operations in its
  order (sequential slot sum, ``div_rn``, the pairwise square sum, correctly rounded sqrt and
  division, no fused multiply-add) and round to bf16 / encode e4m3 on the bits, so the
  interpreter's own bf16 truncation and fp8 misrounding never enter. The one difference left is
  cos/sin: the interpreter's are numpy's float32 ones, which can differ from torch's CPU cos/sin by
  an ulp; a rotated element can then land one bf16 ulp (one e4m3 step) away. ``rows_within_rule``:
  dims past the rotary identical, rotary dims at most one step apart, and identical rows the rule
  for nearly all (>= 95% of the elements here);
- the QSA invariant with every op on its Triton path (a prefill of the whole sequence against
  chunked prefill and drafted decode steps): identical, as asserted by tests/test_qsa_update.py;
- scoring: with integer-valued rows and queries every product and sum is exact, so rows and token
  indices are identical; with random values, scores within 1e-5 relative of the reference's
  (fp32 accumulation order) and the same rows except near-ties.
Every output buffer is poisoned (random bytes) before a kernel runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels import build_qsa_metadata, compress_group_keys, qsa_forward_update, qsa_topk, write_qsa_ring
from kernels.qsa_compress import ref as compress_ref
from kernels.qsa_metadata import ref as metadata_ref
from kernels.qsa_score import ref as score_ref
from kernels.qsa_score.triton import qsa_scores_triton
from kernels.qsa_update import ref as update_ref
from kvcache import BlockLayout, BlockOrder, CacheConfig, CacheDtype, CacheFamily, CachePool, qsa_ring_capacity
from tests.test_qsa_update import EDGE_HISTORIES, Storage, make_history, norm_weight, run_both, state_mismatches

ROPE = {"rotary_dim": 64, "theta": 10000.0, "section": (12, 10, 10)}


def _ordinal(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bf16 / e4m3 bit patterns -> integers in value order (adjacent values differ by 1)."""
    if dtype == torch.bfloat16:
        raw = bits.view(torch.int16).to(torch.int32) & 0xFFFF
        sign, magnitude = raw >= 0x8000, raw & 0x7FFF
    else:
        raw = bits.view(torch.uint8).to(torch.int32)
        sign, magnitude = raw >= 0x80, raw & 0x7F
    return torch.where(sign, -magnitude, magnitude)


def rows_within_rule(got: torch.Tensor, want: torch.Tensor, rotary_dim: int = 64) -> int:
    """The compressed-row rule (module docstring); returns how many elements differ. # got, want: [..., D]"""
    assert got.dtype == want.dtype and got.shape == want.shape
    steps = (_ordinal(got, got.dtype) - _ordinal(want, want.dtype)).abs()
    assert int(steps[..., rotary_dim:].sum()) == 0, "a dim past the rotary differs"
    assert int(steps.amax()) <= 1 if steps.numel() else True, "a rotary element is more than one step away"
    differing = int((steps > 0).sum())
    assert differing <= 0.05 * steps.numel(), f"{differing} of {steps.numel()} elements differ"
    return differing


def _poison(t: torch.Tensor, seed: int) -> None:
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8,
                                            generator=torch.Generator().manual_seed(seed)))


# --- group compression --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 4, 1, 128), (9, 3, 2, 128), (5, 1, 1, 64), (4, 8, 3, 96)],
                         ids=lambda s: "G{}-r{}-H{}-D{}".format(*s))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_compress(force_triton, shape, out_dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    keys = (torch.randn(*shape, generator=gen) * 3).to(torch.bfloat16)
    positions = torch.randint(0, 2 ** 40, (shape[0], 3), generator=gen)
    weight = torch.randn(shape[3], generator=gen) * 0.5
    got = compress_group_keys(keys, positions, weight, eps=1e-6, out_dtype=out_dtype, **ROPE)
    want = compress_ref.compress_group_keys(keys, positions, weight, eps=1e-6, out_dtype=out_dtype, **ROPE)
    rows_within_rule(got, want)


def test_compress_rounding_edges(force_triton):
    """Position 0 (no rotation) isolates the mean, the norm and the casts: values on bf16 halfway points,
    huge and tiny keys, a saturating fp8 weight, and r = 3 (an inexact division) must be bit-identical."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(6, 3, 1, 128, generator=gen)
    keys[1] *= 1e-30
    keys[2] *= 1e30
    keys[3] = 1.0 + 2.0 ** -8  # exactly halfway between bf16 values after the mean
    keys[4, :, :, :64] = 0.0
    keys = keys.to(torch.bfloat16)
    positions = torch.zeros(6, 3, dtype=torch.int64)
    for weight in (torch.randn(128, generator=gen), torch.full((128,), 2000.0)):
        for out_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            got = compress_group_keys(keys, positions, weight, eps=1e-6, out_dtype=out_dtype, **ROPE)
            want = compress_ref.compress_group_keys(keys, positions, weight, eps=1e-6, out_dtype=out_dtype, **ROPE)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_compress_garbage_keys(force_triton, out_dtype):
    """Rejected drafts carry any bits: NaN and inf keys give NaN where the reference has NaN (its NaN bits
    depend on torch's cast path, so a NaN compares as a NaN), and every other byte identical (the zeros of
    an infinite norm included)."""
    gen = torch.Generator().manual_seed(4)
    keys = torch.randint(-2 ** 15, 2 ** 15, (12, 2, 1, 128), generator=gen, dtype=torch.int16).view(torch.bfloat16)
    keys[0, :, :, :64] = float("inf")  # an infinite norm: finite dims become 0, infinite ones NaN
    keys[1, 0, 0, 3] = float("nan")
    positions = torch.zeros(12, 3, dtype=torch.int64)  # no rotation: no cos/sin ulp can enter
    weight = torch.randn(128, generator=gen)
    got = compress_group_keys(keys, positions, weight, eps=1e-6, out_dtype=out_dtype, **ROPE)
    want = compress_ref.compress_group_keys(keys, positions, weight, eps=1e-6, out_dtype=out_dtype, **ROPE)
    assert_same_or_both_nan(got, want)


def assert_same_or_both_nan(got: torch.Tensor, want: torch.Tensor) -> None:
    nan = want.float().isnan()
    assert bool(nan.any()) and torch.equal(got.float().isnan(), nan)
    bits = torch.int16 if want.dtype == torch.bfloat16 else torch.uint8
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])


def test_compress_checks_like_the_reference(force_triton):
    keys = torch.zeros(1, 2, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="first_positions must be int64"):
        compress_group_keys(keys, torch.zeros(1, 3, dtype=torch.int32), torch.zeros(128), eps=1e-6,
                            out_dtype=torch.bfloat16, **ROPE)
    with pytest.raises(ValueError, match="section"):
        compress_group_keys(keys, torch.zeros(1, 3, dtype=torch.int64), torch.zeros(128), eps=1e-6,
                            out_dtype=torch.bfloat16, rotary_dim=64, theta=1e4, section=(10, 10, 10))


# --- ring write ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope", [True, False], ids=["packed-positions", "keys-only"])
@pytest.mark.parametrize("heads, head_size", [(1, 128), (2, 30)], ids=["H1-D128", "H2-D30"])
def test_ring_write(force_triton, rope, heads, head_size):
    gen = torch.Generator().manual_seed(heads * 7 + rope)
    rings, cap = 3, 6
    width = math.ceil(head_size / 4) * 4 + 12 if rope else head_size + 2  # keys-only rows wider than D: zeros
    got = torch.empty(rings, cap, heads, width, dtype=torch.bfloat16)
    _poison(got, 1)
    want = got.clone()
    tokens = 11
    keys = torch.randint(-2 ** 15, 2 ** 15, (tokens, heads, head_size), generator=gen, dtype=torch.int16)
    keys = keys.view(torch.bfloat16)  # any bits, NaN included
    positions = torch.randint(-2 ** 62, 2 ** 62, (tokens, 3), generator=gen) if rope else None
    # ring 2 wraps (positions 4..9 of a ring of 6), ring 0 gets one token, -1 skips the rest
    slots = torch.tensor([-1, -1, 2 * cap + 4, 2 * cap + 5, 2 * cap + 0, 2 * cap + 1, 2 * cap + 2, 2 * cap + 3,
                          -1, 0 * cap + 5, -1])
    write_qsa_ring(got, keys, positions, slots)
    from kernels.qsa_ring import ref as ring_ref

    ring_ref.write_qsa_ring(want, keys, positions, slots)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_ring_write_single_token_and_checks(force_triton):
    ring = torch.zeros(1, 4, 1, 140, dtype=torch.bfloat16)
    keys = torch.ones(1, 1, 128, dtype=torch.bfloat16)
    write_qsa_ring(ring, keys, torch.tensor([[1, 2, 3]]), torch.tensor([3]))
    assert ring[0, 3, 0, 128:].view(torch.int64).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="out of range"):
        write_qsa_ring(ring, keys, torch.tensor([[1, 2, 3]]), torch.tensor([4]))
    with pytest.raises(ValueError, match="name one row twice"):
        write_qsa_ring(ring, keys.expand(2, 1, 128), torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1, 1]))


# --- metadata -----------------------------------------------------------------------------------------------

METADATA_CASES = {
    # (q_lens, seq_lens, r, C, block_size)
    "prefill-longer-than-ring-and-decode": ([10, 4], [10, 7], 4, 8, 8),
    "single-token": ([1], [1], 4, 8, 8),
    "empty-request-between": ([3, 0, 5], [9, 4, 5], 2, 4, 8),
    "drafts-cross-groups": ([4, 4, 4, 4], [13, 16, 4, 30], 4, 8, 16),
    "r1": ([5, 1], [5, 9], 1, 4, 4),
    "r3-odd": ([7, 2, 1], [20, 6, 3], 3, 6, 12),
}


def _metadata_args(q_lens, seq_lens, block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    blocks = max(-(-s // block_size) for s in seq_lens)
    table = torch.randperm(len(seq_lens) * blocks + 3, generator=gen)[:len(seq_lens) * blocks]
    starts = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32)
    rings = torch.randperm(len(seq_lens) + 2, generator=gen)[:len(seq_lens)]
    return (starts, torch.tensor(seq_lens, dtype=torch.int32), table.view(len(seq_lens), blocks).to(torch.int32),
            rings.to(torch.int32))


FIELDS = ("token_to_req", "logical_positions", "visible_blocks", "ring_slot_mapping", "compressed_slot_mapping",
          "k_work", "num_work")


@pytest.mark.parametrize("case", list(METADATA_CASES), ids=list(METADATA_CASES))
def test_metadata(force_triton, case):
    q_lens, seq_lens, r, cap, block_size = METADATA_CASES[case]
    args = _metadata_args(q_lens, seq_lens, block_size, seed=len(case))
    params = {"compress_ratio": r, "ring_capacity": cap, "block_size": block_size}
    got = build_qsa_metadata(*args, **params, num_tokens=sum(q_lens))
    want = metadata_ref.build_qsa_metadata(*args, **params)
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_metadata_pads_tokens_past_the_last_request(force_triton):
    # A caller padding the batch to a captured size on CUDA; on CPU tensors num_tokens must match.
    args = _metadata_args([3, 2], [3, 6], 4, seed=1)
    params = {"compress_ratio": 2, "ring_capacity": 4, "block_size": 4}
    with pytest.raises(ValueError, match="num_tokens 8 != query_start_loc"):
        build_qsa_metadata(*args, **params, num_tokens=8)
    from kernels.qsa_metadata.triton import build_qsa_metadata_triton

    padded = build_qsa_metadata_triton(*args, **params, num_tokens=8)
    exact = metadata_ref.build_qsa_metadata(*args, **params)
    assert padded.token_to_req.tolist() == exact.token_to_req.tolist() + [-1] * 3
    assert padded.logical_positions.tolist() == exact.logical_positions.tolist() + [-1] * 3
    assert padded.ring_slot_mapping.tolist()[5:] == [-1] * 3 and padded.visible_blocks.tolist()[5:] == [0] * 3
    assert padded.k_work.shape[0] == metadata_ref.max_work_items(8, 2, 2)
    assert padded.num_work.tolist() == exact.num_work.tolist() == [2]
    assert padded.k_work.tolist() == exact.k_work.tolist()[:2] + [[-1, -1]] * (padded.k_work.shape[0] - 2)


def test_metadata_checks_values_on_cpu(force_triton):
    args = list(_metadata_args([2, 2], [2, 4], 4, seed=2))
    args[2][1, 0] = -1  # request 1's group 1 would be written to block -1
    with pytest.raises(ValueError, match=r"request 1: block_table column 0 holds block -1"):
        build_qsa_metadata(*args, compress_ratio=2, ring_capacity=4, block_size=4)


# --- forward update -------------------------------------------------------------------------------------------


def _qsa_pool(dtype: CacheDtype, order: BlockOrder, heads: int, r: int, num_spec: int, seed: int) -> CachePool:
    cap = qsa_ring_capacity(r, num_spec)
    config = CacheConfig(family=CacheFamily.QSA, layer_names=("l0", "l1"), block_size=math.lcm(r, cap, 8),
                         num_spec=num_spec, mla_entry_bytes=8, order=order, compress_ratio=r, qsa_num_heads=heads,
                         qsa_dtype=dtype)
    pool = CachePool(BlockLayout(config), num_blocks=12, num_rings=4)
    _poison(pool.blocks, seed)
    _poison(pool.rings, seed + 1)
    return pool


@pytest.mark.parametrize(
    "dtype, order, heads, rope",
    [(CacheDtype.BFLOAT16, BlockOrder.BLNHC, 1, True), (CacheDtype.FP8_E4M3, BlockOrder.BLHNC, 2, True),
     (CacheDtype.BFLOAT16, BlockOrder.BLHNC, 2, False)],
    ids=["bf16-BLNHC-rope-cached", "fp8-BLHNC-2heads-rope-cached", "bf16-BLHNC-2heads-text-rope"],
)
def test_forward_update(force_triton, dtype, order, heads, rope):
    """Three forwards over four requests, the same inputs on both paths: a prefill, a second chunk
    that straddles a group and is longer than the ring, decode steps with drafts wrapping the ring,
    a single-token request, and an idle one (no tokens: its slots are never written)."""
    r, num_spec = 4, 3
    got_pool, want_pool = _qsa_pool(dtype, order, heads, r, num_spec, 5), _qsa_pool(dtype, order, heads, r, num_spec, 5)
    cap, block_size = got_pool.config.qsa_ring.capacity, got_pool.config.block_size
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(128, generator=gen) * 0.5
    table = torch.randperm(12, generator=gen)[:12].view(4, 3).to(torch.int32)
    rings = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    lengths = [0, 0, 0, 0]
    for q_lens in ([5, 1, 7, 0], [13, 1, 4, 0], [4, 4, 4, 0]):
        seq = [length + q for length, q in zip(lengths, q_lens)]
        starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        cols = max(-(-s // block_size) for s in seq)
        meta = build_qsa_metadata(starts, torch.tensor(seq, dtype=torch.int32), table[:, :cols].contiguous(), rings,
                                  compress_ratio=r, ring_capacity=cap, block_size=block_size)
        keys = (torch.randn(sum(q_lens), heads, 128, generator=gen) * 2).to(torch.bfloat16)
        positions = torch.randint(0, 2 ** 33, (sum(q_lens), 3), generator=gen)
        spec = got_pool.config.qsa_keys
        kwargs = {"compress_ratio": r, "block_size": block_size, "eps": spec.norm_eps, "cache_rope_positions": rope,
                  **ROPE}
        qsa_forward_update(keys, positions, meta, got_pool.qsa_ring("l1"), got_pool.qsa_keys("l1"), weight, **kwargs)
        update_ref.qsa_forward_update(keys, positions, meta, want_pool.qsa_ring("l1"), want_pool.qsa_keys("l1"),
                                      weight, **kwargs)
        lengths = seq
    assert torch.equal(got_pool.rings, want_pool.rings)
    got, want = got_pool.qsa_keys("l1"), want_pool.qsa_keys("l1")
    rows_within_rule(got.contiguous(), want.contiguous())
    outside = got_pool.blocks.clone()
    patched = CachePool(got_pool.layout, num_blocks=12, num_rings=1)
    patched.blocks = outside
    patched.qsa_keys("l1").copy_(want)
    assert torch.equal(outside, want_pool.blocks), "bytes outside layer l1's compressed rows differ"


def test_forward_update_checks_values_on_cpu(force_triton):
    pool = _qsa_pool(CacheDtype.BFLOAT16, BlockOrder.BLNHC, 1, 2, 0, 1)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    meta = build_qsa_metadata(i32([0, 2, 4]), i32([2, 2]), i32([[1], [1]]), i32([0, 1]), compress_ratio=2,
                              ring_capacity=2, block_size=pool.config.block_size)
    with pytest.raises(ValueError, match=r"two groups of this forward map to one compressed row"):
        qsa_forward_update(torch.zeros(4, 1, 128, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.int64), meta,
                           pool.qsa_ring(0), pool.qsa_keys(0), torch.zeros(128), compress_ratio=2,
                           block_size=pool.config.block_size, eps=1e-6, cache_rope_positions=True, **ROPE)


@pytest.mark.parametrize("case", ["chunk-longer-than-ring-after-straddle", "every-draft-rejected",
                                  "one-token-request-beside-a-long-one"])
def test_qsa_invariant_through_the_kernels(force_triton, case):
    r, num_spec, plans = EDGE_HISTORIES[case]
    storage = Storage(r=r, num_spec=num_spec, rope=True, dtype=CacheDtype.FP8_E4M3, order=BlockOrder.BLHNC)
    gen = torch.Generator().manual_seed(7)
    histories = [make_history(chunks, steps, storage, gen) for chunks, steps in plans]
    weight = norm_weight(7)
    whole, stepped = run_both(storage, histories, weight)
    assert state_mismatches(whole, histories, weight) == []
    assert state_mismatches(stepped, histories, weight) == []


# --- scoring + top-k ------------------------------------------------------------------------------------------


def _score_inputs(dtype, integer: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    r, block_size, kv_heads, head_size = 4, 16, 2, 64
    cache = torch.empty(7, kv_heads, block_size // r, head_size, dtype=dtype.torch_dtype).permute(0, 2, 1, 3)  # BLHNC
    values = torch.randint(-3, 4, cache.shape, generator=gen) if integer else torch.randn(cache.shape, generator=gen)
    cache.copy_(values.to(cache.dtype))
    q = (torch.randint(-3, 4, (5, 4, head_size), generator=gen) if integer
         else torch.randn(5, 4, head_size, generator=gen)).to(torch.bfloat16)
    table = torch.tensor([[0, 1, 2], [3, 4, -1], [5, -1, -1], [6, 2, 1], [1, -1, -1]], dtype=torch.int32)
    seq_lens = torch.tensor([45, 30, 3, 48, 0], dtype=torch.int32)  # 11, 7, 0, 12 and 0 visible rows
    return q, cache, table, seq_lens, {"compress_ratio": r, "block_size": block_size}


@pytest.mark.parametrize("dtype", [CacheDtype.BFLOAT16, CacheDtype.FP8_E4M3], ids=lambda d: d.value)
@pytest.mark.parametrize("topk", [1, 4, 20], ids=lambda k: f"top{k}")
def test_topk_exact_on_integer_values(force_triton, dtype, topk):
    q, cache, table, seq_lens, params = _score_inputs(dtype, True, 1)
    rows, tokens = qsa_topk(q, cache, table, seq_lens, **params, topk=topk)
    want_rows, want_tokens = score_ref.qsa_topk(q, cache, table, seq_lens, **params, topk=topk)
    assert torch.equal(rows, want_rows) and torch.equal(tokens, want_tokens)


@pytest.mark.parametrize("dtype", [CacheDtype.BFLOAT16, CacheDtype.FP8_E4M3], ids=lambda d: d.value)
def test_scores_within_accumulation_error(force_triton, dtype):
    q, cache, table, seq_lens, params = _score_inputs(dtype, False, 2)
    scores = qsa_scores_triton(q, cache, table, seq_lens, **params)
    rows, _ = qsa_topk(q, cache, table, seq_lens, **params, topk=12)
    want_rows, _ = score_ref.qsa_topk(q, cache, table, seq_lens, **params, topk=12)
    assert torch.equal(rows < 0, want_rows < 0)
    for b, visible in enumerate((seq_lens // 4).tolist()):
        assert bool(torch.isinf(scores[b, visible:]).all())
        for j in range(visible):  # the reference's score, row by row
            block, row = int(table[b, j * 4 // 16]), j % 4
            k = cache[block, row].float().repeat_interleave(2, dim=0)
            want = torch.relu((q[b].float() * k).sum(-1)).sum() / math.sqrt(64)
            assert abs(float(scores[b, j]) - float(want)) <= 1e-5 * max(1.0, abs(float(want)))
        same = rows[b] == want_rows[b]
        for i in torch.nonzero(~same).flatten().tolist():  # only a near-tie may swap
            a, c = float(scores[b, rows[b, i]]), float(scores[b, want_rows[b, i]])
            assert abs(a - c) <= 2e-5 * max(1.0, abs(c))


def test_topk_checks_values_on_cpu(force_triton):
    q, cache, table, seq_lens, params = _score_inputs(CacheDtype.BFLOAT16, True, 3)
    table[0, 1] = 9
    with pytest.raises(ValueError, match="block 9, outside the cache's blocks"):
        qsa_topk(q, cache, table, seq_lens, **params, topk=2)
