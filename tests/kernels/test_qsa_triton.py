"""The QSA kernels against their torch references, each body once, on every backend that runs kernels:
Triton's CPU interpreter here, compiled on CUDA through tests/gpu/test_qsa_gpu.py (tests/support/kernel_backends.py).

Comparison rules:
- ring writes and every ring byte of a forward update: identical (integer and byte moves only);
- compressed rows (compress, forward update): the kernels do the reference's fp32 operations in its
  order (sequential slot sum, ``div_rn``, the pairwise square sum, correctly rounded sqrt and
  division, no fused multiply-add) and round to bf16 / encode e4m3 on the bits, so the
  interpreter's own bf16 truncation and fp8 misrounding never enter. Compiled, the kernels call the
  CUDA math library's cos/sin, as torch does on CUDA: identical to the reference run on the same CUDA
  tensors. In the interpreter cos/sin are numpy's float32 ones, which can differ from torch's CPU
  cos/sin by an ulp; a rotated element can then land one bf16 ulp (one e4m3 step) away.
  ``rows_within_rule``: dims past the rotary identical, rotary dims at most one step apart, and
  identical rows the rule for nearly all (>= 95% of the elements here);
- the QSA invariant with every op on its Triton path (a prefill of the whole sequence against
  chunked prefill and drafted decode steps): identical (tests/kernels/test_qsa_update.py, every backend);
The metadata builder's bodies are tests/kernels/test_qsa_metadata_kernel.py's, the scoring's
tests/kernels/test_qsa_score_kernel.py's. Every output buffer is poisoned (random bytes) before a kernel runs.
"""

from __future__ import annotations

import math

import pytest
import torch

from kpool_pd.kernels import build_qsa_metadata, compress_group_keys, qsa_forward_update, write_qsa_ring
from kpool_pd.kernels.qsa_compress import ref as compress_ref
from kpool_pd.kernels.qsa_rope import RopeCache
from kpool_pd.kernels.qsa_ring import ref as ring_ref
from kpool_pd.kernels.qsa_update import ref as update_ref
from kpool_pd.kvcache import BlockLayout, BlockOrder, CacheConfig, CacheDtype, CacheFamily, CachePool, qsa_ring_capacity
from tests.support.kernel_backends import KERNEL_BACKENDS, Backend, make_backend, poison

ROPE = {"rotary_dim": 64, "theta": 10000.0, "section": (12, 10, 10)}

TABLE_POSITIONS = 4096  # rows of the RopeCache of the forward update cases that have one


def draw_positions(n: int, table: str | None, gen: torch.Generator) -> torch.Tensor:
    """[n, 3] int64 MRoPE positions: table None, up to 2**33; "held", all below TABLE_POSITIONS; "some", each
    axis below it or up to 2**33 at random (groups whose pairs are partly held)."""
    far = torch.randint(0, 2 ** 33, (n, 3), generator=gen)
    if table is None:
        return far
    near = torch.randint(0, TABLE_POSITIONS, (n, 3), generator=gen)
    if table == "held":
        return near
    return torch.where(torch.rand(n, 3, generator=gen) < 0.5, near, far)


def table_for(table: str | None, device: torch.device) -> RopeCache | None:
    """The RopeCache of a case: "held" gets a doctored one (the cos/sin of theta 500 labelled theta 10000: values
    that no computation of this rotary gives, so rows equal to the reference's show that both read the table, at
    the same rows, pairs and halves); "some" the true table."""
    if table is None:
        return None
    if table == "held":
        other = RopeCache.build(TABLE_POSITIONS, rotary_dim=ROPE["rotary_dim"], theta=500.0, device=device)
        return RopeCache(rotary_dim=ROPE["rotary_dim"], theta=ROPE["theta"], table=other.table)
    return RopeCache.build(TABLE_POSITIONS, rotary_dim=ROPE["rotary_dim"], theta=ROPE["theta"], device=device)


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


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=False)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


# --- group compression --------------------------------------------------------------------------------


COMPRESS_SHAPES = [(1, 4, 1, 128), (9, 3, 2, 128), (5, 1, 1, 64), (4, 8, 3, 96), (4099, 4, 2, 128),
                   (257, 3, 1, 96), (64, 1, 8, 128)]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("shape", COMPRESS_SHAPES, ids=lambda s: "G{}-r{}-H{}-D{}".format(*s))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_compress(backend, shape, out_dtype):
    if not backend.is_cuda and shape[0] * shape[2] > 64:
        pytest.skip("large shapes run compiled only (the interpreter's time)")
    gen = torch.Generator().manual_seed(sum(shape))
    keys = (torch.randn(*shape, generator=gen) * 3).to(torch.bfloat16)
    positions = torch.randint(0, 2 ** 40, (shape[0], 3), generator=gen)
    weight = torch.randn(shape[3], generator=gen) * 0.5
    args = tuple(t.to(backend.device) for t in (keys, positions, weight))
    got = compress_group_keys(*args, eps=1e-6, out_dtype=out_dtype, **ROPE)
    want = compress_ref.compress_group_keys(*args, eps=1e-6, out_dtype=out_dtype, **ROPE)  # on the same device
    if backend.is_cuda:
        assert same_bytes(got, want), f"{int((got.view(torch.uint8) != want.view(torch.uint8)).sum())} bytes differ"
        cpu = compress_ref.compress_group_keys(keys, positions, weight, eps=1e-6, out_dtype=out_dtype, **ROPE)
        print(f"compress {shape}: {rows_within_rule(got.cpu(), cpu)} elements differ from the CPU reference")
    else:
        rows_within_rule(got, want)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
def test_compress_rounding_edges(backend):
    """Position 0 (no rotation) isolates the mean, the norm and the casts: values on bf16 halfway points,
    huge and tiny keys, a saturating fp8 weight, and r = 3 (an inexact division) must be bit-identical."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(6, 3, 1, 128, generator=gen)
    keys[1] *= 1e-30
    keys[2] *= 1e30
    keys[3] = 1.0 + 2.0 ** -8  # exactly halfway between bf16 values after the mean
    keys[4, :, :, :64] = 0.0
    keys = keys.to(torch.bfloat16)
    keys, positions = keys.to(backend.device), torch.zeros(6, 3, dtype=torch.int64, device=backend.device)
    for weight in (torch.randn(128, generator=gen), torch.full((128,), 2000.0)):
        weight = weight.to(backend.device)
        for out_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            got = compress_group_keys(keys, positions, weight, eps=1e-6, out_dtype=out_dtype, **ROPE)
            want = compress_ref.compress_group_keys(keys, positions, weight, eps=1e-6, out_dtype=out_dtype, **ROPE)
            assert same_bytes(got, want)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_compress_garbage_keys(backend, out_dtype):
    """Rejected drafts carry any bits: NaN and inf keys give NaN where the reference has NaN (its NaN bits
    depend on torch's cast path, so a NaN compares as a NaN), and every other byte identical (the zeros of
    an infinite norm included)."""
    gen = torch.Generator().manual_seed(4)
    keys = torch.randint(-2 ** 15, 2 ** 15, (12, 2, 1, 128), generator=gen, dtype=torch.int16).view(torch.bfloat16)
    keys[0, :, :, :64] = float("inf")  # an infinite norm: finite dims become 0, infinite ones NaN
    keys[1, 0, 0, 3] = float("nan")
    # no rotation in the interpreter (no cos/sin ulp can enter); compiled, any position (CUDA's cos/sin)
    positions = backend.pick(torch.zeros(12, 3, dtype=torch.int64), torch.randint(0, 2 ** 40, (12, 3), generator=gen))
    weight = torch.randn(128, generator=gen)
    args = tuple(t.to(backend.device) for t in (keys, positions, weight))
    got = compress_group_keys(*args, eps=1e-6, out_dtype=out_dtype, **ROPE)
    want = compress_ref.compress_group_keys(*args, eps=1e-6, out_dtype=out_dtype, **ROPE)
    assert_same_or_both_nan(got.cpu(), want.cpu())


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("table", ["held", "some"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_compress_reads_the_rope_cache(backend, table, out_dtype):
    """Given a RopeCache, kernel and reference read the positions it holds from it and compute the others:
    identical rows on CUDA; in the interpreter identical where the (doctored) table holds every position
    ("held", no cos/sin computed), within the rule otherwise. On CUDA the true table gives the rows that
    computing gives."""
    gen = torch.Generator().manual_seed(12)
    groups = backend.pick(12, 700)
    keys = (torch.randn(groups, 4, 2, 128, generator=gen) * 3).to(torch.bfloat16)
    positions = draw_positions(groups, table, gen)
    weight = torch.randn(128, generator=gen) * 0.5
    rope_cache = table_for(table, backend.device)
    args = tuple(t.to(backend.device) for t in (keys, positions, weight))
    got = compress_group_keys(*args, eps=1e-6, out_dtype=out_dtype, rope_cache=rope_cache, **ROPE)
    want = compress_ref.compress_group_keys(*args, eps=1e-6, out_dtype=out_dtype, rope_cache=rope_cache, **ROPE)
    if backend.is_cuda or table == "held":
        assert same_bytes(got, want)
    else:
        rows_within_rule(got, want)
    computed = compress_ref.compress_group_keys(*args, eps=1e-6, out_dtype=out_dtype, **ROPE)
    if table == "held":
        assert not same_bytes(got, computed), "the doctored table's values were not read"
    elif backend.is_cuda:  # the true table holds the values the reference computes on the device
        assert same_bytes(got, computed)


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


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("rope", [True, False], ids=["packed-positions", "keys-only"])
@pytest.mark.parametrize("heads, head_size", [(1, 128), (2, 30), (2, 128)], ids=["H1-D128", "H2-D30", "H2-D128"])
def test_ring_write(backend, rope, heads, head_size):
    gen = torch.Generator().manual_seed(heads * 7 + rope)
    rings, cap, tokens = backend.pick((3, 6, 11), (64, 8, 300))
    width = math.ceil(head_size / 4) * 4 + 12 if rope else head_size + 2  # keys-only rows wider than D: zeros
    got = torch.empty(rings, cap, heads, width, dtype=torch.bfloat16, device=backend.device)
    poison(got, 1)
    want = got.cpu().clone()
    keys = torch.randint(-2 ** 15, 2 ** 15, (tokens, heads, head_size), generator=gen, dtype=torch.int16)
    keys = keys.view(torch.bfloat16)  # any bits, NaN included
    positions = torch.randint(-2 ** 62, 2 ** 62, (tokens, 3), generator=gen) if rope else None
    if backend.is_cuda:
        slots = torch.randperm(rings * cap, generator=gen)[:tokens]
        slots[::7] = -1
    else:  # ring 2 wraps (positions 4..9 of a ring of 6), ring 0 gets one token, -1 skips the rest
        slots = torch.tensor([-1, -1, 2 * cap + 4, 2 * cap + 5, 2 * cap + 0, 2 * cap + 1, 2 * cap + 2, 2 * cap + 3,
                              -1, 0 * cap + 5, -1])
    if heads == 2:  # one int dtype rule: slots may be int32 or int64
        slots = slots.to(torch.int32)
    write_qsa_ring(got, keys.to(backend.device), positions.to(backend.device) if rope else None,
                   slots.to(backend.device))
    ring_ref.write_qsa_ring(want, keys, positions, slots)
    assert same_bytes(got, want)


def test_ring_write_single_token_and_checks(force_triton):  # value checks: CPU tensors only
    ring = torch.zeros(1, 4, 1, 140, dtype=torch.bfloat16)
    keys = torch.ones(1, 1, 128, dtype=torch.bfloat16)
    write_qsa_ring(ring, keys, torch.tensor([[1, 2, 3]]), torch.tensor([3]))
    assert ring[0, 3, 0, 128:].view(torch.int64).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="out of range"):
        write_qsa_ring(ring, keys, torch.tensor([[1, 2, 3]]), torch.tensor([4]))
    with pytest.raises(ValueError, match="name one row twice"):
        write_qsa_ring(ring, keys.expand(2, 1, 128), torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1, 1]))


# --- forward update -------------------------------------------------------------------------------------------


def qsa_pool(dtype: CacheDtype, order: BlockOrder, heads: int, r: int, num_spec: int, *, blocks: int, rings: int,
             seed: int, device: torch.device, block_base: int = 8) -> CachePool:
    """A poisoned QSA pool: two layers, blocks of lcm(r, C, block_base) tokens."""
    cap = qsa_ring_capacity(r, num_spec)
    config = CacheConfig(family=CacheFamily.QSA, layer_names=("l0", "l1"), block_size=math.lcm(r, cap, block_base),
                         num_spec=num_spec, mla_entry_bytes=block_base, order=order, compress_ratio=r,
                         qsa_num_heads=heads, qsa_dtype=dtype, cache_rope_positions=True)
    pool = CachePool(BlockLayout(config), num_blocks=blocks, num_rings=rings, device=device)
    poison(pool.blocks, seed)
    poison(pool.rings, seed + 1)
    return pool


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize(
    "dtype, order, heads, rope, table",
    [(CacheDtype.BFLOAT16, BlockOrder.BLNHC, 1, True, None), (CacheDtype.FP8_E4M3, BlockOrder.BLHNC, 2, True, None),
     (CacheDtype.BFLOAT16, BlockOrder.BLHNC, 2, False, None), (CacheDtype.BFLOAT16, BlockOrder.BLNHC, 1, True, "held"),
     (CacheDtype.FP8_E4M3, BlockOrder.BLHNC, 2, True, "some")],
    ids=["bf16-BLNHC-rope-cached", "fp8-BLHNC-2heads-rope-cached", "bf16-BLHNC-2heads-text-rope",
         "bf16-BLNHC-rope-table-holds-all", "fp8-BLHNC-2heads-rope-table-holds-some"],
)
def test_forward_update(backend, dtype, order, heads, rope, table):
    """Forwards over a batch, the same inputs on both paths: a prefill, a second chunk that straddles a group
    (longer than the ring), decode steps with drafts wrapping the ring, single-token and idle requests (no
    tokens: their slots are never written). In the interpreter: four requests, four fixed forwards; compiled:
    24 requests, five random forwards. A forward of more tokens than requests x C takes the ring write over
    each request's last C tokens. With a RopeCache (``table_for``) both paths read it: where it holds every
    position, the interpreter's rows are identical too (no cos/sin is computed)."""
    r, num_spec = 4, 3
    rope_cache = table_for(table, backend.device)
    requests, columns = backend.pick((4, 6), (24, 24))
    pools = [qsa_pool(dtype, order, heads, r, num_spec, blocks=requests * columns, rings=requests, seed=5,
                      device=backend.device, block_base=backend.pick(8, 64)) for _ in range(2)]
    got_pool, want_pool = pools
    cap, block_size = got_pool.config.qsa_ring.capacity, got_pool.config.block_size
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(128, generator=gen) * 0.5).to(backend.device)
    table = torch.randperm(requests * columns, generator=gen).view(requests, columns).to(torch.int32)
    rings = torch.tensor([2, 0, 3, 1]) if requests == 4 else torch.randperm(requests, generator=gen)
    if backend.is_cuda:
        plans = [torch.randint(1, 700, (requests,), generator=gen).tolist()]
        plans += [torch.randint(low, high, (requests,), generator=gen).tolist()
                  for low, high in ((1, 300), (0, 5), (0, 5), (1, 2))]
    else:
        plans = [[5, 1, 7, 0], [13, 1, 4, 0], [4, 4, 4, 0], [21, 9, 3, 0]]  # the last: more tokens than 4 x C
    spec = got_pool.config.qsa_keys
    kwargs = {"compress_ratio": r, "block_size": block_size, "eps": spec.norm_eps, "cache_rope_positions": rope,
              "rope_cache": rope_cache, **ROPE}
    lengths = [0] * requests
    for q_lens in plans:
        seq = [length + q for length, q in zip(lengths, q_lens)]
        starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        cols = max(-(-s // block_size) for s in seq)
        meta = build_qsa_metadata(starts.to(backend.device),
                                  torch.tensor(seq, dtype=torch.int32, device=backend.device),
                                  table[:, :cols].contiguous().to(backend.device),
                                  rings.to(torch.int32).to(backend.device), compress_ratio=r, ring_capacity=cap,
                                  block_size=block_size, num_tokens=sum(q_lens))
        keys = (torch.randn(sum(q_lens), heads, 128, generator=gen) * 2).to(torch.bfloat16).to(backend.device)
        positions = draw_positions(sum(q_lens), table, gen).to(backend.device)
        qsa_forward_update(keys, positions, meta, got_pool.qsa_ring("l1"), got_pool.qsa_keys("l1"), weight, **kwargs)
        update_ref.qsa_forward_update(keys, positions, meta, want_pool.qsa_ring("l1"), want_pool.qsa_keys("l1"),
                                      weight, **kwargs)  # on the same device
        lengths = seq
    assert torch.equal(got_pool.rings, want_pool.rings)
    if backend.is_cuda or table == "held":
        assert torch.equal(got_pool.blocks, want_pool.blocks)
        return
    got, want = got_pool.qsa_keys("l1"), want_pool.qsa_keys("l1")
    rows_within_rule(got.contiguous(), want.contiguous())
    outside = got_pool.blocks.clone()
    patched = CachePool(got_pool.layout, num_blocks=got_pool.num_blocks, num_rings=1)
    patched.blocks = outside
    patched.qsa_keys("l1").copy_(want)
    assert torch.equal(outside, want_pool.blocks), "bytes outside layer l1's compressed rows differ"


def test_forward_update_checks_values_on_cpu(force_triton):
    pool = qsa_pool(CacheDtype.BFLOAT16, BlockOrder.BLNHC, 1, 2, 0, blocks=12, rings=4, seed=1,
                    device=torch.device("cpu"))
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    meta = build_qsa_metadata(i32([0, 2, 4]), i32([2, 2]), i32([[1], [1]]), i32([0, 1]), compress_ratio=2,
                              ring_capacity=2, block_size=pool.config.block_size)
    with pytest.raises(ValueError, match=r"two groups of this forward map to one compressed row"):
        qsa_forward_update(torch.zeros(4, 1, 128, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.int64), meta,
                           pool.qsa_ring(0), pool.qsa_keys(0), torch.zeros(128), compress_ratio=2,
                           block_size=pool.config.block_size, eps=1e-6, cache_rope_positions=True, **ROPE)
