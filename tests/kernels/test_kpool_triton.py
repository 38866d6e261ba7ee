"""The kpool kernels against their torch references, each body once, on every backend that runs kernels:
Triton's CPU interpreter here, compiled on CUDA through tests/gpu/test_kpool_gpu.py (tests/support/kernel_backends.py).

Comparison rules:
- keep_last entries, ring rows, paged write/read, and every byte outside the entries written:
  identical. The kernels round to bf16 and encode e4m3 on the bits, so the interpreter's own
  fp32->bf16 truncation and fp8 misrounding never enter;
- softmax entries: exp is the one operation that differs between implementations (numpy's in the
  interpreter, libdevice's expf compiled, torch's own in the reference), by an ulp on some inputs, which
  moves a pooled element by a bf16 ulp in rare pools (measured in the interpreter: 2 of 4096 pools for
  kpool 4, 5 of 4096 for kpool 8): tests/conftest.py ``entries_within_rule`` states the bound. The
  reference runs on CPU tensors (torch's CUDA division by a Python scalar multiplies by the reciprocal,
  so the reference's fp32 scales on CUDA can sit an ulp from the correctly rounded ones);
- prefill-batched against decode-incremental compression of the same pools, through the public ops on
  any backend (the reference's included): identical;
- scoring: scores to 1e-4 relative (fp32 accumulation order), same pools except near-ties.
Every output buffer is poisoned (random bytes) before the kernel runs. The ops that address the indexer cache run
over block geometries of one kernel page (S <= P) and of two and four pages of 32 and of 64 states (GEOMETRIES).
"""

from __future__ import annotations

import pytest
import torch

from kpool_pd.kernels import (kpool_compress, kpool_decode_update, kpool_indexer_topk, kpool_prefill, kpool_read_entries,
                     kpool_write_entries)
from kpool_pd.kernels.dispatch import use_triton
from kpool_pd.kernels.kpool_compress.ref import compress_pools
from kpool_pd.kernels.kpool_decode.ref import decode_update
from kpool_pd.kernels.kpool_decode.triton import decode_update_triton
from kpool_pd.kernels.kpool_prefill.ref import prefill_compress_write, seed_tail_ring
from kpool_pd.kernels.kpool_score.ref import indexer_topk
from kpool_pd.kvcache import BlockLayout, CacheConfig, CachePool, PoolMode
from tests.support.kernel_backends import ALL_BACKENDS, INTERPRETER, KERNEL_BACKENDS, Backend, make_backend, poison

D = 128
CONFIG = CacheConfig(layer_names=("l0", "l1"), block_size=64, kpool=4, num_spec=3)
# Block geometries (S states a block, P states a kernel page): one page (S <= P), and blocks of 2 and 4 kernel
# pages of 32 and of 64 states.
GEOMETRIES = {
    "S16-one-page": CONFIG,
    "S64-two-pages-of-32": CacheConfig(layer_names=("l0", "l1"), block_size=256, kpool=4, num_spec=3,
                                       kernel_page_states=32),
    "S128-two-pages-of-64": CacheConfig(layer_names=("l0", "l1"), block_size=256, kpool=2, num_spec=3),
    "S128-four-pages-of-32": CacheConfig(layer_names=("l0", "l1"), block_size=256, kpool=2, num_spec=3,
                                         kernel_page_states=32),
    "S256-four-pages-of-64": CacheConfig(layer_names=("l0", "l1"), block_size=512, kpool=2, num_spec=3),
}
# The interpreter is slow: softmax (checked by a rule, not bytes) runs on the one-page and the 256-token two-page
# geometry; keep_last (byte identity) on every geometry.
GEOMETRY_CASES = [pytest.param(name, mode, id=f"{name}-{mode.value}") for name in GEOMETRIES for mode in PoolMode
                  if mode is PoolMode.KEEP_LAST or name in ("S16-one-page", "S128-two-pages-of-64")]


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=False)


def keys(count: int, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """# -> k, gate: [count, 128] bf16 on device"""
    k = torch.randn(count, D, generator=gen).to(torch.bfloat16)
    return k.to(device), (2 * torch.randn(count, D, generator=gen)).to(torch.bfloat16).to(device)


def make_pool(config: CacheConfig, num_blocks: int, num_rings: int, seed: int, device: torch.device) -> CachePool:
    """A cache pool whose every byte is random (poison: an unwritten byte never matches)."""
    pool = CachePool(BlockLayout(config), num_blocks=num_blocks, num_rings=num_rings, device=device)
    poison(pool.blocks, seed)
    poison(pool.rings, seed + 1)
    return pool


def _qsl(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def assert_pools_match(pool: CachePool, ref_pool: CachePool, layer: int, mode: PoolMode, rule) -> None:
    """Rings and every byte outside the indexer entries identical; entries by the rule (keep_last: identical)."""
    assert torch.equal(pool.rings.cpu(), ref_pool.rings.cpu())
    iq, iscale = pool.indexer_q(layer), pool.indexer_scale(layer)
    ref_iq, ref_iscale = ref_pool.indexer_q(layer), ref_pool.indexer_scale(layer)
    differing = rule(iq.reshape(-1, D), iscale.reshape(-1), ref_iq.reshape(-1, D), ref_iscale.reshape(-1))
    if mode is PoolMode.KEEP_LAST:
        assert differing == 0
    patched = CachePool(pool.layout, num_blocks=pool.num_blocks, num_rings=1)
    patched.blocks = pool.blocks.cpu().clone()
    patched.indexer_q(layer).copy_(ref_iq.cpu())
    patched.indexer_scale(layer).copy_(ref_iscale.cpu())
    assert torch.equal(patched.blocks, ref_pool.blocks.cpu()), "bytes outside the indexer entries differ"


def test_cpu_tensors_run_the_reference_unless_forced(monkeypatch):
    monkeypatch.delenv("KPOOL_PD_FORCE_TRITON", raising=False)
    assert not use_triton(torch.zeros(1))
    monkeypatch.setenv("KPOOL_PD_FORCE_TRITON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        use_triton(torch.zeros(1))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("size", ["one", "many"])
@pytest.mark.parametrize("kpool", [2, 3, 4, 8], ids=lambda k: f"kpool{k}")
@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
@pytest.mark.parametrize("round_scale", [True, False], ids=["ue8m0", "fp32scale"])
def test_compress(backend, entry_rule, size, kpool, mode, round_scale):
    pools = 1 if size == "one" else backend.pick(13, 4099)
    gen = torch.Generator().manual_seed(pools * 17 + kpool)
    k, gate = keys(pools * kpool, gen, backend.device)
    k, gate = k.view(pools, kpool, D), gate.view(pools, kpool, D)
    ape = torch.randn(kpool, D, generator=gen).to(backend.device)
    q, scale = kpool_compress(k, gate, ape, mode=mode, round_scale=round_scale)
    q_ref, scale_ref = compress_pools(k.cpu(), gate.cpu(), ape.cpu(), mode=mode, round_scale=round_scale)
    differing = entry_rule(q, scale, q_ref, scale_ref)
    if mode is PoolMode.KEEP_LAST:
        assert differing == 0
    print(f"\ncompress P={pools} kpool={kpool} {mode.value} on {backend}: {differing} rows differ from the reference")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
def test_compress_encodes_rounding_edges_like_torch(backend):
    """keep_last passes x through: rows built so that y hits bf16 and e4m3 halfway points, subnormals
    and the top of a binade (where the interpreter's own conversions misround)."""
    gen = torch.Generator().manual_seed(9)
    rows = [torch.randn(D, generator=gen) * s for s in (1e-3, 0.1, 1.0, 30.0, 1e4)]
    rows.append(torch.linspace(-1, 1, D))
    rows.append(torch.full((D,), 124.5))
    rows.append(torch.zeros(D))  # amax floor
    x = torch.stack(rows).to(torch.bfloat16)
    k = torch.zeros(len(rows), 2, D, dtype=torch.bfloat16)
    k[:, 1] = x
    for round_scale in (True, False):
        q, scale = kpool_compress(k.to(backend.device), k.to(backend.device), torch.zeros(2, D, device=backend.device),
                                  mode="keep_last", round_scale=round_scale)
        q_ref, scale_ref = compress_pools(k, k, torch.zeros(2, D), mode=PoolMode.KEEP_LAST, round_scale=round_scale)
        assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(scale.cpu(), scale_ref)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("geometry,mode", GEOMETRY_CASES)
def test_prefill(backend, entry_rule, geometry, mode):
    config = GEOMETRIES[geometry]
    device, bs, kpool = backend.device, config.block_size, config.kpool
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 4, bs + 3, 2 * bs + 2, 7, 0, 3]  # a single token, odd sizes, an empty request, 3 blocks
    k, gate = keys(sum(lengths), gen, torch.device("cpu"))
    qsl = _qsl(lengths, torch.device("cpu"))
    ape = torch.randn(kpool, D, generator=gen)
    tables = torch.randperm(21, generator=gen).view(7, 3).to(torch.int32)
    tables[4] = -1  # no blocks: nothing written
    tables[3, 2] = -1  # request 3's pools from position 2 * bs have no block
    ring_ids = torch.tensor([0, 1, 2, 3, -1, 4, 5])  # -1: no ring seeded
    pool, ref_pool = make_pool(config, 21, 6, 1, device), make_pool(config, 21, 6, 1, torch.device("cpu"))
    kpool_prefill(k.to(device), gate.to(device), ape.to(device), qsl.to(device), tables.to(device), ring_ids.to(device),
                  pool.indexer_q(1), pool.indexer_scale(1), pool.tail_ring(1), mode=mode)
    zeros = torch.zeros(len(lengths), dtype=torch.int64)
    prefill_compress_write(k, gate, ape, qsl, zeros, tables, ring_ids, ref_pool.tail_ring(1), ref_pool.indexer_q(1),
                           ref_pool.indexer_scale(1), mode=mode, round_scale=True)
    seed_tail_ring(k, gate, qsl, zeros, ring_ids, ref_pool.tail_ring(1), kpool=kpool)
    assert_pools_match(pool, ref_pool, 1, mode, entry_rule)


LAUNCHES = ((None, "default"), ((4, 2), "4-requests-a-program"), ((2, 1), "2-requests-1-warp"))
DECODE_CASES = [pytest.param(*case.values, launch, id=f"{case.id}-{launch_id}") for case in GEOMETRY_CASES
                for launch, launch_id in LAUNCHES if launch is None or case.values[0] == "S16-one-page"]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("geometry,mode,launch", DECODE_CASES)
def test_decode_step_with_drafts(backend, entry_rule, geometry, mode, launch):
    config = GEOMETRIES[geometry]
    device, bs, kpool = backend.device, config.block_size, config.kpool
    page_tokens = config.family_spec.states_per_page * kpool
    gen = torch.Generator().manual_seed(4)
    lengths = [4, 1, 3, 2, 4, 11, 0, 4]  # drafts; a single token; 11 tokens overrun the ring of 8
    # 6..9 and 13..16 wrap around the ring; bs - 2.., 2 * bs - 1.. and page_tokens - 2.. cross a block or page edge
    starts = torch.tensor([13, 0, bs - 2, 2 * bs - 1, 6, 3 * bs - 11, 40, page_tokens - 2])
    k, gate = keys(sum(lengths), gen, torch.device("cpu"))
    qsl = _qsl(lengths, torch.device("cpu"))
    ape = torch.randn(kpool, D, generator=gen)
    tables = torch.randperm(24, generator=gen).view(8, 3).to(torch.int32)
    tables[5, 2] = -1  # request 5's pools from position 2 * bs have no block: skipped
    ring_ids = torch.tensor([2, 0, 3, 1, 5, 4, 6, 7])
    pool, ref_pool = make_pool(config, 24, 8, 2, device), make_pool(config, 24, 8, 2, torch.device("cpu"))
    earlier = torch.randn(ref_pool.tail_ring(0).shape, generator=gen).to(torch.bfloat16)
    pool.tail_ring(0).copy_(earlier)  # earlier steps' keys: finite (the reference's max propagates NaN; the kernel's
    # does not)
    ref_pool.tail_ring(0).copy_(earlier)
    args = (k, gate, starts, qsl, ring_ids, tables, ape)
    views = (pool.tail_ring(0), pool.indexer_q(0), pool.indexer_scale(0))
    if launch is None:
        kpool_decode_update(*(a.to(device) for a in args), *views, mode=mode)
    else:  # a launch variant of the kernel (several requests a program, fewer warps)
        decode_update_triton(*(a.to(device) for a in args), *views, mode=mode, round_scale=True, block_r=launch[0],
                             num_warps=launch[1])
    decode_update(*args, ref_pool.tail_ring(0), ref_pool.indexer_q(0), ref_pool.indexer_scale(0), mode=mode,
                  round_scale=True)
    assert_pools_match(pool, ref_pool, 0, mode, entry_rule)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_write_and_read_entries(backend, geometry):
    config = GEOMETRIES[geometry]
    device, states, page = backend.device, config.block_size // config.kpool, config.family_spec.states_per_page
    gen = torch.Generator().manual_seed(6)
    pool, ref_pool = make_pool(config, 12, 2, 4, device), make_pool(config, 12, 2, 4, torch.device("cpu"))
    q = torch.randn(37, D, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(37, generator=gen)
    slots = torch.randperm(12 * states, generator=gen)[:37]
    slots[[3, 17]] = -1
    kpool_write_entries(pool.indexer_q(1), pool.indexer_scale(1), q.to(device), scale.to(device), slots.to(device))
    live = slots >= 0
    block, state = slots[live] // states, slots[live] % states
    ref_pool.indexer_q(1)[block, state // page, state % page] = q[live]
    ref_pool.indexer_scale(1)[block, state // page, state % page] = scale[live]
    assert torch.equal(pool.blocks.cpu(), ref_pool.blocks)
    got_q, got_scale = kpool_read_entries(pool.indexer_q(1), pool.indexer_scale(1), slots[live].to(device),
                                          dequantize=False)
    assert torch.equal(got_q.cpu().view(torch.uint8), q[live].view(torch.uint8))
    assert torch.equal(got_scale.cpu(), scale[live])
    every_code = torch.arange(256, dtype=torch.uint8)
    every_code = every_code[(every_code & 0x7F) != 0x7F]  # every finite e4m3 value
    codes = every_code.repeat(-(-2 * states * D // every_code.numel()))[: 2 * states * D]
    pool.indexer_q(0)[:2] = codes.view(pool.indexer_q(0)[:2].shape).view(torch.float8_e4m3fn).to(device)
    pool.indexer_scale(0)[:2] = (torch.rand(pool.indexer_scale(0)[:2].shape, generator=gen) + 0.5).to(device)  # finite
    deq = kpool_read_entries(pool.indexer_q(0), pool.indexer_scale(0), torch.arange(2 * states, device=device))
    want = pool.indexer_q(0)[:2].reshape(-1, D).float() * pool.indexer_scale(0)[:2].reshape(-1, 1)
    assert torch.equal(deq.cpu(), want.cpu())


def assert_topk_close(pools, scores, ref_pools, ref_scores, rtol: float = 1e-4) -> None:
    """Same pools (a near-tie may swap), scores to rtol of the largest. # all: [B, topk] on CPU"""
    assert torch.equal(pools < 0, ref_pools < 0)
    live = ref_pools >= 0
    tol = rtol * float(ref_scores[live].abs().max().clamp_min(1.0)) if bool(live.any()) else 0.0
    if bool(live.any()):
        assert float((scores[live] - ref_scores[live]).abs().max()) <= tol
    swapped = (pools != ref_pools) & live
    assert bool(((scores - ref_scores).abs()[swapped] <= 2 * tol).all())  # only near-ties may swap


TOPK_CASES = [pytest.param("S16-one-page", heads, id=f"S16-one-page-H{heads}") for heads in (1, 6, 17)] + [
    pytest.param(name, 6, id=f"{name}-H6") for name in GEOMETRIES if name != "S16-one-page"]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("geometry,heads", TOPK_CASES)
def test_indexer_topk(backend, geometry, heads):
    config = GEOMETRIES[geometry]
    device, bs, kpool = backend.device, config.block_size, config.kpool
    gen = torch.Generator().manual_seed(7)
    pool = make_pool(config, 40, 2, 5, device)
    pool.indexer_scale(0).copy_(torch.rand(pool.indexer_scale(0).shape, generator=gen) + 0.1)
    pool.indexer_q(0).copy_(torch.randn(pool.indexer_q(0).shape, generator=gen).to(torch.float8_e4m3fn))
    seq_lens = torch.tensor([3, 4, bs + 6, 3 * bs - 1, 10 * bs])  # the last runs past its 8 blocks
    tables = torch.randperm(40, generator=gen).view(5, 8).to(torch.int32)
    q = torch.randn(5, heads, D, generator=gen).to(torch.bfloat16)
    weights = torch.randn(5, heads, generator=gen)
    for topk in (5, 200):
        pools, scores = kpool_indexer_topk(q.to(device), weights.to(device), seq_lens.to(device), tables.to(device),
                                           pool.indexer_q(0), pool.indexer_scale(0), kpool=kpool, topk=topk)
        ref_pools, ref_scores = indexer_topk(q, weights, seq_lens, tables, pool.indexer_q(0).cpu(),
                                             pool.indexer_scale(0).cpu(), kpool=kpool, topk=topk)
        assert_topk_close(pools.cpu(), scores.cpu(), ref_pools, ref_scores)


# --- the PD invariant through the public ops: batched prefill and drafted decode give the same bytes ----------


class Request:
    """One request's caches in a poisoned pool on a device (non-contiguous block ids), driven by the public ops."""

    def __init__(self, config: CacheConfig, max_tokens: int, ape: torch.Tensor, seed: int,
                 device: torch.device) -> None:
        self.config, self.device = config, device
        blocks = -(-max_tokens // config.block_size)
        self.pool = make_pool(config, 3 * blocks + 1, 3, seed, device)
        order = torch.randperm(3 * blocks + 1, generator=torch.Generator().manual_seed(seed))
        self.block_table = order[:blocks].view(1, blocks).to(torch.int32).to(device)
        self.ring_id = torch.tensor([2], device=device)
        self.ape = ape.to(device)

    def views(self):
        return self.pool.tail_ring(0), self.pool.indexer_q(0), self.pool.indexer_scale(0)

    def prefill(self, k: torch.Tensor, gate: torch.Tensor) -> None:
        ring, iq, iscale = self.views()
        qsl = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=self.device)
        kpool_prefill(k.to(self.device), gate.to(self.device), self.ape, qsl, self.block_table, self.ring_id, iq,
                      iscale, ring, mode=self.config.pool_mode, round_scale=self.config.round_scale)

    def step(self, k: torch.Tensor, gate: torch.Tensor, start: int) -> None:
        ring, iq, iscale = self.views()
        kpool_decode_update(k.to(self.device), gate.to(self.device), torch.tensor([start], device=self.device),
                            torch.tensor([0, k.shape[0]], device=self.device), self.ring_id, self.block_table,
                            self.ape, ring, iq, iscale, mode=self.config.pool_mode,
                            round_scale=self.config.round_scale)

    def snapshot(self, length: int) -> tuple[bytes, bytes, bytes]:
        """Every complete pool's q and scale bytes in pool order, and the ring's open pool (K then gate)."""
        kpool, states = self.config.kpool, self.config.block_size // self.config.kpool
        pools = torch.arange(length // kpool, device=self.device)
        slots = self.block_table[0, pools * kpool // self.config.block_size].long() * states + pools % states
        q, scale = kpool_read_entries(*self.views()[1:], slots, dequantize=False)
        ring = self.views()[0]
        positions = torch.arange(length // kpool * kpool, length, device=self.device) % ring.shape[2]
        open_pool = torch.cat([ring[2, 0, positions], ring[2, 1, positions]])
        return (q.view(torch.uint8).cpu().numpy().tobytes(), scale.cpu().numpy().tobytes(),
                open_pool.view(torch.int16).cpu().numpy().tobytes())


def run_history(cache: Request, k, gate, prompt: int, accepts: list[int], num_spec: int, gen) -> int:
    """Prefill ``prompt`` tokens, then one step per entry of ``accepts`` (drafts accepted in that step; the
    rejected ones carry garbage keys); returns the committed length."""
    total = k.shape[0]
    cache.prefill(k[:prompt], gate[:prompt])
    length = prompt
    for accepted in accepts:
        if length >= total:
            break
        accepted = min(accepted, num_spec, total - length - 1)
        step_k, step_gate = keys(1 + num_spec, gen, torch.device("cpu"))  # garbage for the rejected drafts
        step_k[: 1 + accepted] = k[length:length + 1 + accepted]
        step_gate[: 1 + accepted] = gate[length:length + 1 + accepted]
        cache.step(step_k, step_gate, length)
        length += 1 + accepted
    return length


INVARIANT_CASES = [(4, 3, PoolMode.SOFTMAX), (2, 1, PoolMode.KEEP_LAST), (8, 7, PoolMode.SOFTMAX),
                   (2, 0, PoolMode.SOFTMAX), (4, 7, PoolMode.KEEP_LAST), (8, 1, PoolMode.KEEP_LAST)]


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
@pytest.mark.parametrize("kpool,num_spec,mode", INVARIANT_CASES,
                         ids=[f"kpool{k}-spec{s}-{m.value}" for k, s, m in INVARIANT_CASES])
def test_prefill_and_drafted_decode_give_the_same_bytes(backend, kpool, num_spec, mode):
    """A prefill of the whole sequence against a prefix prefill plus drafted decode steps (random accepts, and
    every draft rejected), at lengths around the pool, ring and block boundaries: identical bytes."""
    if backend.name == INTERPRETER and (kpool, num_spec, mode) not in INVARIANT_CASES[:3]:
        pytest.skip("the interpreter runs the first three cases (time); the reference and CUDA run every case")
    config = CacheConfig(kpool=kpool, num_spec=num_spec, block_size=16 * kpool, pool_mode=mode)
    gen = torch.Generator().manual_seed(kpool * 100 + num_spec)
    ring = config.tail_ring.ring_size
    lengths = backend.pick([ring + 1], [1, kpool - 1, kpool, ring + 1, config.block_size, 2 * config.block_size + 3])
    for total in sorted({max(n, 1) for n in lengths}):
        k, gate = keys(total, gen, torch.device("cpu"))
        ape = torch.randn(kpool, D, generator=gen)
        full = Request(config, total + num_spec, ape, total, backend.device)
        full.prefill(k, gate)
        expected = full.snapshot(total)
        for prompt in sorted({1, max(1, total // 2)} if backend.is_cuda else {min(kpool + 1, total)}):
            accepts = torch.randint(0, num_spec + 1, (total,), generator=gen).tolist()
            drafted = Request(config, total + num_spec, ape, total + 7, backend.device)
            assert run_history(drafted, k, gate, prompt, accepts, num_spec, gen) == total
            assert drafted.snapshot(total) == expected, f"length {total}, prompt {prompt}, accepts {accepts}"
            rejected = Request(config, total + num_spec, ape, total + 9, backend.device)
            assert run_history(rejected, k, gate, prompt, [0] * total, num_spec, gen) == total
            assert rejected.snapshot(total) == expected, f"length {total}, prompt {prompt}, every draft rejected"
