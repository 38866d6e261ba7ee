"""The kpool Triton kernels compiled on a CUDA device, against the torch references.

Comparison rules (see also tests/test_kpool_triton.py for the interpreter):
- keep_last, the ring rows, the paged write/read: byte-identical to the reference, on CUDA or CPU;
- entries against the reference (on the same CUDA tensors or on CPU): the kernels do the
  reference's operations in its order, but exp is libdevice's expf in the kernel and torch's own exp
  in the reference, which differ by an ulp on some inputs (test_exp_ulp_difference measures it), and
  torch's CUDA division by a Python scalar (amax / 448) multiplies by the reciprocal, so fp32 scales
  of the reference on CUDA can sit an ulp from the correctly rounded ones (the kernel's and the CPU
  reference's). Rule: tests/conftest.py ``entries_within_rule``. The tests print how many rows differ;
- prefill-batched and decode-incremental compression of the same pools on the GPU: byte-identical
  (both run the same kernel arithmetic), asserted by test_pd_invariant_on_cuda;
- scoring: scores to fp32 accumulation error (1e-4 relative), the same top-k pools where scores are
  apart by more than that.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels import (kpool_compress, kpool_decode_update, kpool_indexer_topk, kpool_prefill, kpool_read_entries,
                     kpool_write_entries)
from kernels.kpool_compress.ref import compress_pools
from kernels.kpool_decode.ref import decode_update
from kernels.kpool_prefill.ref import prefill_compress_write, seed_tail_ring
from kernels.kpool_score.ref import indexer_topk
from kvcache import BlockLayout, CacheConfig, CachePool, PoolMode

@triton.jit
def _exp_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, libdevice.exp(tl.load(x_ptr + offs)))


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device: run tests/gpu/run_all.sh on the H200 through the device tool"),
]

D = 128


def _keys(count: int, gen: torch.Generator, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(count, D, generator=gen).to(torch.bfloat16)
    gate = (2 * torch.randn(count, D, generator=gen)).to(torch.bfloat16)
    return k.to(device), gate.to(device)


def _pool(config: CacheConfig, num_blocks: int, num_rings: int, seed: int) -> CachePool:
    """A CUDA cache pool whose every byte is random (poison: an unwritten byte never matches)."""
    pool = CachePool(BlockLayout(config), num_blocks=num_blocks, num_rings=num_rings, device="cuda")
    gen = torch.Generator().manual_seed(seed)
    pool.blocks.copy_(torch.randint(0, 256, pool.blocks.shape, generator=gen, dtype=torch.uint8))
    pool.rings.copy_(torch.randint(0, 256, pool.rings.shape, generator=gen, dtype=torch.uint8))
    return pool


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("pools", [1, 257, 4096], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("kpool", [2, 3, 4, 8], ids=lambda k: f"kpool{k}")
@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
@pytest.mark.parametrize("round_scale", [True, False], ids=["ue8m0", "fp32scale"])
def test_compress_matches_reference(pools, kpool, mode, round_scale, entry_rule):
    gen = torch.Generator().manual_seed(pools * 31 + kpool)
    k, gate = _keys(pools * kpool, gen)
    k, gate = k.view(pools, kpool, D), gate.view(pools, kpool, D)
    ape = torch.randn(kpool, D, generator=gen).cuda()
    q, scale = kpool_compress(k, gate, ape, mode=mode, round_scale=round_scale)
    q_ref, scale_ref = compress_pools(k, gate, ape, mode=mode, round_scale=round_scale)  # reference on CUDA
    on_cuda = entry_rule(q, scale, q_ref, scale_ref)
    q_cpu, scale_cpu = compress_pools(k.cpu(), gate.cpu(), ape.cpu(), mode=mode, round_scale=round_scale)
    on_cpu = entry_rule(q, scale, q_cpu, scale_cpu)
    if mode is PoolMode.KEEP_LAST:
        assert on_cpu == 0 and (on_cuda == 0 or not round_scale)
    print(f"\ncompress P={pools} kpool={kpool} {mode.value}: rows differing from the reference on CUDA {on_cuda}, "
          f"on CPU {on_cpu}")


def test_exp_ulp_difference():
    """libdevice's expf (the kernels) against torch.exp on CUDA and on CPU, over softmax-like arguments."""
    x = -20 * torch.rand(1 << 20, generator=torch.Generator().manual_seed(8))
    x = x.cuda()
    y = torch.empty_like(x)
    _exp_kernel[(x.numel() // 1024,)](x, y, BLOCK=1024)
    ulps_cuda = (y.view(torch.int32) - torch.exp(x).view(torch.int32)).abs()
    ulps_cpu = (y.cpu().view(torch.int32) - torch.exp(x.cpu()).view(torch.int32)).abs()
    print(f"\nexp ulp differences over {x.numel()} args: vs torch CUDA {int((ulps_cuda > 0).sum())} "
          f"(max {int(ulps_cuda.max())}), vs torch CPU {int((ulps_cpu > 0).sum())} (max {int(ulps_cpu.max())})")
    assert int(ulps_cuda.max()) <= 2 and int(ulps_cpu.max()) <= 2


CONFIG = CacheConfig(layer_names=("l0", "l1"), block_size=64, kpool=4, num_spec=3)


@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
def test_prefill_matches_reference(mode):
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 4, 67, 130, 7, 0, 3]
    k, gate = _keys(sum(lengths), gen)
    qsl = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32).cuda()
    ape = torch.randn(4, D, generator=gen).cuda()
    perm = torch.randperm(21, generator=gen)
    tables = perm.view(7, 3).to(torch.int32)
    tables[4] = -1  # no blocks: nothing written
    tables[3, 2] = -1  # request 3's last pools (positions 128..) have no block
    tables = tables.cuda()
    ring_ids = torch.tensor([0, 1, 2, 3, -1, 4, 5]).cuda()
    triton_pool, ref_pool = _pool(CONFIG, 21, 6, 1), _pool(CONFIG, 21, 6, 1)
    kpool_prefill(k, gate, ape, qsl, tables, ring_ids, triton_pool.indexer_q(1), triton_pool.indexer_scale(1),
                  triton_pool.tail_ring(1), mode=mode)
    prefill_compress_write(k, gate, ape, qsl, tables, ref_pool.indexer_q(1), ref_pool.indexer_scale(1), mode=mode,
                           round_scale=True)
    seed_tail_ring(k, gate, qsl, ring_ids, ref_pool.tail_ring(1), kpool=4)
    assert_pools_match(triton_pool, ref_pool, 1, mode)


def assert_pools_match(pool: CachePool, ref_pool: CachePool, layer: int, mode: PoolMode, round_scale=True) -> None:
    """Rings and every byte outside the indexer entries identical; entries by the module's rule."""
    assert torch.equal(pool.rings, ref_pool.rings)
    iq, iscale = pool.indexer_q(layer), pool.indexer_scale(layer)
    ref_iq, ref_iscale = ref_pool.indexer_q(layer), ref_pool.indexer_scale(layer)
    from conftest import entries_within_rule

    differing = entries_within_rule(iq.reshape(-1, D), iscale.reshape(-1), ref_iq.reshape(-1, D), ref_iscale.reshape(-1))
    if mode is PoolMode.KEEP_LAST:
        assert differing == 0
    print(f"\n{mode.value}: {differing} entries differ from the reference on CUDA")
    patched = pool.blocks.clone()
    patched_pool = CachePool(pool.layout, num_blocks=pool.num_blocks, num_rings=1, device="cuda")
    patched_pool.blocks = patched
    patched_pool.indexer_q(layer).copy_(ref_iq)
    patched_pool.indexer_scale(layer).copy_(ref_iscale)
    assert torch.equal(patched, ref_pool.blocks), "bytes outside the indexer entries differ"


@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
def test_decode_matches_reference(mode):
    gen = torch.Generator().manual_seed(4)
    lengths = [4, 1, 3, 2, 4, 5, 0]  # drafts; a single token; 5 tokens wrap the ring of 8 twice over a step
    starts = torch.tensor([13, 0, 62, 127, 6, 190, 40])  # 6..9 and 13..16 wrap around the ring
    k, gate = _keys(sum(lengths), gen)
    qsl = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32).cuda()
    ape = torch.randn(4, D, generator=gen).cuda()
    tables = torch.randperm(21, generator=gen).view(7, 3).to(torch.int32)
    tables[5, 2] = -1  # position 191 completes pool 47 in block column 2: skipped
    tables = tables.cuda()
    ring_ids = torch.tensor([2, 0, 3, 1, 5, 4, 6]).cuda()
    triton_pool, ref_pool = _pool(CONFIG, 21, 7, 2), _pool(CONFIG, 21, 7, 2)
    earlier = torch.randn(ref_pool.tail_ring(0).shape, generator=gen).to(torch.bfloat16).cuda()
    for ring in (triton_pool.tail_ring(0), ref_pool.tail_ring(0)):
        ring.copy_(earlier)  # earlier steps' keys: finite (the reference's max propagates NaN, the kernel's not)
    args = (k, gate, starts.cuda(), qsl, ring_ids, tables, ape)
    kpool_decode_update(*args, triton_pool.tail_ring(0), triton_pool.indexer_q(0), triton_pool.indexer_scale(0),
                        mode=mode)
    decode_update(*args, ref_pool.tail_ring(0), ref_pool.indexer_q(0), ref_pool.indexer_scale(0), mode=mode,
                  round_scale=True)
    assert_pools_match(triton_pool, ref_pool, 0, mode)


def test_decode_is_graph_capturable_and_never_syncs():
    gen = torch.Generator().manual_seed(5)
    batch, tokens = 64, 4
    pool, ref_pool = _pool(CONFIG, 3 * batch, batch, 3), _pool(CONFIG, 3 * batch, batch, 3)
    k, gate = _keys(batch * tokens, gen)
    starts = torch.randint(0, 180, (batch,), generator=gen).cuda()
    qsl = torch.arange(0, batch * tokens + 1, tokens, dtype=torch.int32).cuda()
    ring_ids = torch.randperm(batch, generator=gen).cuda()
    tables = torch.randperm(3 * batch, generator=gen).view(batch, 3).to(torch.int32).cuda()
    ape = torch.randn(4, D, generator=gen).cuda()
    earlier = torch.randn(pool.tail_ring(0).shape, generator=gen).to(torch.bfloat16).cuda()
    pool.tail_ring(0).copy_(earlier)  # finite earlier keys (see test_decode_matches_reference)
    ref_pool.tail_ring(0).copy_(earlier)
    views = (pool.tail_ring(0), pool.indexer_q(0), pool.indexer_scale(0))
    first_k, first_gate = k.clone(), gate.clone()
    kpool_decode_update(k, gate, starts, qsl, ring_ids, tables, ape, *views)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation raises
    try:
        kpool_decode_update(k, gate, starts, qsl, ring_ids, tables, ape, *views)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kpool_decode_update(k, gate, starts, qsl, ring_ids, tables, ape, *views)
    new_k, new_gate = _keys(batch * tokens, gen)
    k.copy_(new_k)
    gate.copy_(new_gate)
    graph.replay()
    ref_views = (ref_pool.tail_ring(0), ref_pool.indexer_q(0), ref_pool.indexer_scale(0))
    for step_k, step_gate in ((first_k, first_gate), (first_k, first_gate), (new_k, new_gate)):
        decode_update(step_k, step_gate, starts, qsl, ring_ids, tables, ape, *ref_views, mode=PoolMode.SOFTMAX,
                      round_scale=True)
    assert_pools_match(pool, ref_pool, 0, PoolMode.SOFTMAX)


def test_write_read_entries_match_reference():
    gen = torch.Generator().manual_seed(6)
    pool, ref_pool = _pool(CONFIG, 12, 2, 4), _pool(CONFIG, 12, 2, 4)
    q = torch.randn(37, D, generator=gen).to(torch.float8_e4m3fn).cuda()
    scale = torch.rand(37, generator=gen).cuda()
    slots = torch.randperm(12 * 16, generator=gen)[:37]
    slots[[3, 17]] = -1
    slots = slots.cuda()
    kpool_write_entries(pool.indexer_q(1), pool.indexer_scale(1), q, scale, slots)
    live = slots >= 0
    states = 16
    ref_pool.indexer_q(1)[slots[live] // states, slots[live] % states] = q[live]
    ref_pool.indexer_scale(1)[slots[live] // states, slots[live] % states] = scale[live]
    assert torch.equal(pool.blocks, ref_pool.blocks)
    got_q, got_scale = kpool_read_entries(pool.indexer_q(1), pool.indexer_scale(1), slots[live], dequantize=False)
    assert _same_bytes(got_q, q[live]) and _same_bytes(got_scale, scale[live])
    deq = kpool_read_entries(pool.indexer_q(1), pool.indexer_scale(1), slots[live])
    assert torch.equal(deq, q[live].float() * scale[live, None])


@pytest.mark.parametrize("heads", [1, 6, 64], ids=lambda h: f"H{h}")
def test_indexer_topk_matches_reference(heads):
    gen = torch.Generator().manual_seed(7)
    pool = _pool(CONFIG, 40, 2, 5)
    pool.indexer_scale(0).copy_(torch.rand(40, 16, generator=gen).cuda() + 0.1)
    pool.indexer_q(0).copy_(torch.randn(40, 16, 128, generator=gen).to(torch.float8_e4m3fn).cuda())
    seq_lens = torch.tensor([3, 4, 70, 191, 640]).cuda()
    tables = torch.randperm(40, generator=gen)[:40].view(5, 8).to(torch.int32).cuda()
    q = torch.randn(5, heads, D, generator=gen).to(torch.bfloat16).cuda()
    weights = torch.randn(5, heads, generator=gen).cuda()
    for topk in (5, 200):
        pools, scores = kpool_indexer_topk(q, weights, seq_lens, tables, pool.indexer_q(0), pool.indexer_scale(0),
                                           kpool=4, topk=topk)
        ref_pools, ref_scores = indexer_topk(q.cpu(), weights.cpu(), seq_lens.cpu(), tables.cpu(),
                                             pool.indexer_q(0).cpu(), pool.indexer_scale(0).cpu(), kpool=4, topk=topk)
        assert_topk_close(pools.cpu(), scores.cpu(), ref_pools, ref_scores)


def assert_topk_close(pools, scores, ref_pools, ref_scores, rtol: float = 1e-4) -> None:
    assert torch.equal(pools < 0, ref_pools < 0)
    live = ref_pools >= 0
    tol = rtol * ref_scores[live].abs().max().clamp_min(1.0)
    if bool(live.any()):
        assert float((scores[live] - ref_scores[live]).abs().max()) <= tol
    for b in range(pools.shape[0]):
        for i in range(pools.shape[1]):
            if pools[b, i] != ref_pools[b, i]:  # only a near-tie may swap
                assert abs(float(ref_scores[b, i]) - float(scores[b, i])) <= 2 * tol


# --- the PD invariant on CUDA tensors: batched prefill and drafted decode give the same bytes ---------------


class CudaRequest:
    """One request's caches in a poisoned CUDA pool (non-contiguous block ids), driven by the public ops."""

    def __init__(self, config: CacheConfig, max_tokens: int, ape: torch.Tensor, seed: int) -> None:
        self.config = config
        blocks = -(-max_tokens // config.block_size)
        self.pool = _pool(config, 3 * blocks + 1, 3, seed)
        gen = torch.Generator().manual_seed(seed)
        self.block_table = torch.randperm(3 * blocks + 1, generator=gen)[:blocks].view(1, blocks).to(torch.int32).cuda()
        self.ring_id = torch.tensor([2]).cuda()
        self.ape = ape

    def views(self):
        return self.pool.tail_ring(0), self.pool.indexer_q(0), self.pool.indexer_scale(0)

    def prefill(self, k, gate) -> None:
        ring, iq, iscale = self.views()
        qsl = torch.tensor([0, k.shape[0]], dtype=torch.int32).cuda()
        kpool_prefill(k, gate, self.ape, qsl, self.block_table, self.ring_id, iq, iscale, ring,
                      mode=self.config.pool_mode, round_scale=self.config.round_scale)

    def step(self, k, gate, start: int) -> None:
        ring, iq, iscale = self.views()
        kpool_decode_update(k, gate, torch.tensor([start]).cuda(), torch.tensor([0, k.shape[0]]).cuda(), self.ring_id,
                            self.block_table, self.ape, ring, iq, iscale, mode=self.config.pool_mode,
                            round_scale=self.config.round_scale)

    def snapshot(self, length: int) -> tuple[bytes, bytes, bytes]:
        kpool, states = self.config.kpool, self.config.block_size // self.config.kpool
        pools = torch.arange(length // kpool).cuda()
        slots = self.block_table[0, pools * kpool // self.config.block_size].long() * states + pools % states
        q, scale = kpool_read_entries(*self.views()[1:], slots, dequantize=False)
        ring = self.views()[0]
        positions = torch.arange(length // kpool * kpool, length).cuda() % ring.shape[2]
        open_pool = torch.cat([ring[2, 0, positions], ring[2, 1, positions]])
        return (q.view(torch.uint8).cpu().numpy().tobytes(), scale.cpu().numpy().tobytes(),
                open_pool.view(torch.int16).cpu().numpy().tobytes())


def _history(cache: CudaRequest, k, gate, prompt: int, accepts: list[int], num_spec: int, gen) -> int:
    total = k.shape[0]
    cache.prefill(k[:prompt], gate[:prompt])
    length = prompt
    for accepted in accepts:
        if length >= total:
            break
        accepted = min(accepted, num_spec, total - length - 1)
        step_k, step_gate = _keys(1 + num_spec, gen)  # garbage for the rejected drafts
        step_k[: 1 + accepted] = k[length:length + 1 + accepted]
        step_gate[: 1 + accepted] = gate[length:length + 1 + accepted]
        cache.step(step_k, step_gate, length)
        length += 1 + accepted
    return length


@pytest.mark.parametrize("kpool", [2, 4, 8], ids=lambda k: f"kpool{k}")
@pytest.mark.parametrize("num_spec", [0, 1, 3, 7], ids=lambda s: f"spec{s}")
@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
def test_pd_invariant_on_cuda(kpool, num_spec, mode):
    config = CacheConfig(kpool=kpool, num_spec=num_spec, block_size=16 * kpool, pool_mode=mode)
    gen = torch.Generator().manual_seed(kpool * 100 + num_spec)
    for total in (1, kpool - 1, kpool, config.tail_ring.ring_size + 1, config.block_size, 2 * config.block_size + 3):
        total = max(total, 1)
        k, gate = _keys(total, gen)
        ape = torch.randn(kpool, D, generator=gen).cuda()
        full = CudaRequest(config, total + num_spec, ape, seed=total)
        full.prefill(k, gate)
        expected = full.snapshot(total)
        for prompt in sorted({1, max(1, total // 2), total}):
            accepts = torch.randint(0, num_spec + 1, (total,), generator=gen).tolist()
            drafted = CudaRequest(config, total + num_spec, ape, seed=total + 7)
            assert _history(drafted, k, gate, prompt, accepts, num_spec, gen) == total
            assert drafted.snapshot(total) == expected, f"length {total}, prompt {prompt}, accepts {accepts}"
            rejected = CudaRequest(config, total + num_spec, ape, seed=total + 9)
            assert _history(rejected, k, gate, prompt, [0] * total, num_spec, gen) == total
            assert rejected.snapshot(total) == expected, f"length {total}, prompt {prompt}, all drafts rejected"
