"""The kpool Triton kernels in Triton's CPU interpreter, against the torch references.

Comparison rules in the interpreter:
- keep_last entries, ring rows, paged write/read, and every byte outside the entries written:
  identical. The kernels round to bf16 and encode e4m3 on the bits, so the interpreter's own
  fp32->bf16 truncation and fp8 misrounding never enter;
- softmax entries: the interpreter's exp is numpy's, an ulp from torch's CPU exp on some inputs
  (about 40% of random arguments), which moves a pooled element by a bf16 ulp in rare pools
  (measured: 2 of 4096 pools for kpool 4, 5 of 4096 for kpool 8): tests/conftest.py
  ``entries_within_rule`` states the bound;
- prefill-batched against decode-incremental compression of the same pools, both through the
  kernels: identical;
- scoring: scores to 1e-4 relative (fp32 accumulation order), same pools except near-ties.
Every output buffer is poisoned (random bytes) before the kernel runs.
"""

from __future__ import annotations

import pytest
import torch

from kernels import (kpool_compress, kpool_decode_update, kpool_indexer_topk, kpool_prefill, kpool_read_entries,
                     kpool_write_entries)
from kernels.dispatch import use_triton
from kernels.kpool_compress.ref import compress_pools
from kernels.kpool_decode.ref import decode_update
from kernels.kpool_prefill.ref import prefill_compress_write, seed_tail_ring
from kernels.kpool_score.ref import indexer_topk
from kvcache import BlockLayout, CacheConfig, CachePool, PoolMode

D = 128
CONFIG = CacheConfig(layer_names=("l0", "l1"), block_size=64, kpool=4, num_spec=3)


def _keys(count: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(count, D, generator=gen).to(torch.bfloat16), (2 * torch.randn(count, D, generator=gen)).to(
        torch.bfloat16)


def _pool(config: CacheConfig, num_blocks: int, num_rings: int, seed: int) -> CachePool:
    pool = CachePool(BlockLayout(config), num_blocks=num_blocks, num_rings=num_rings)
    gen = torch.Generator().manual_seed(seed)
    pool.blocks.random_(0, 256, generator=gen)  # poison: an unwritten byte never matches
    pool.rings.random_(0, 256, generator=gen)
    return pool


def _qsl(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def assert_pools_match(pool: CachePool, ref_pool: CachePool, layer: int, mode: PoolMode, rule) -> None:
    assert torch.equal(pool.rings, ref_pool.rings)
    iq, iscale = pool.indexer_q(layer), pool.indexer_scale(layer)
    ref_iq, ref_iscale = ref_pool.indexer_q(layer), ref_pool.indexer_scale(layer)
    differing = rule(iq.reshape(-1, D), iscale.reshape(-1), ref_iq.reshape(-1, D), ref_iscale.reshape(-1))
    if mode is PoolMode.KEEP_LAST:
        assert differing == 0
    outside = pool.blocks.clone()
    patched = CachePool(pool.layout, num_blocks=pool.num_blocks, num_rings=1)
    patched.blocks = outside
    patched.indexer_q(layer).copy_(ref_iq)
    patched.indexer_scale(layer).copy_(ref_iscale)
    assert torch.equal(outside, ref_pool.blocks), "bytes outside the indexer entries differ"


def test_cpu_tensors_run_the_reference_unless_forced(monkeypatch):
    monkeypatch.delenv("KPOOL_PD_FORCE_TRITON", raising=False)
    assert not use_triton(torch.zeros(1))
    monkeypatch.setenv("KPOOL_PD_FORCE_TRITON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        use_triton(torch.zeros(1))


@pytest.mark.parametrize("pools", [1, 13], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("kpool", [2, 3, 4, 8], ids=lambda k: f"kpool{k}")
@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
@pytest.mark.parametrize("round_scale", [True, False], ids=["ue8m0", "fp32scale"])
def test_compress(force_triton, entry_rule, pools, kpool, mode, round_scale):
    gen = torch.Generator().manual_seed(pools * 17 + kpool)
    k, gate = _keys(pools * kpool, gen)
    k, gate = k.view(pools, kpool, D), gate.view(pools, kpool, D)
    ape = torch.randn(kpool, D, generator=gen)
    q, scale = kpool_compress(k, gate, ape, mode=mode, round_scale=round_scale)
    q_ref, scale_ref = compress_pools(k, gate, ape, mode=mode, round_scale=round_scale)
    differing = entry_rule(q, scale, q_ref, scale_ref)
    if mode is PoolMode.KEEP_LAST:
        assert differing == 0


def test_compress_encodes_rounding_edges_like_torch(force_triton):
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
        q, scale = kpool_compress(k, k, torch.zeros(2, D), mode="keep_last", round_scale=round_scale)
        q_ref, scale_ref = compress_pools(k, k, torch.zeros(2, D), mode=PoolMode.KEEP_LAST, round_scale=round_scale)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert torch.equal(scale, scale_ref)


@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
def test_prefill(force_triton, entry_rule, mode):
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 4, 67, 130, 7, 0, 3]  # a single token, odd sizes, an empty request
    k, gate = _keys(sum(lengths), gen)
    qsl = _qsl(lengths)
    ape = torch.randn(4, D, generator=gen)
    tables = torch.randperm(21, generator=gen).view(7, 3).to(torch.int32)
    tables[4] = -1  # no blocks: nothing written
    tables[3, 2] = -1  # request 3's pools from position 128 have no block
    ring_ids = torch.tensor([0, 1, 2, 3, -1, 4, 5])  # -1: no ring seeded
    pool, ref_pool = _pool(CONFIG, 21, 6, 1), _pool(CONFIG, 21, 6, 1)
    kpool_prefill(k, gate, ape, qsl, tables, ring_ids, pool.indexer_q(1), pool.indexer_scale(1), pool.tail_ring(1),
                  mode=mode)
    prefill_compress_write(k, gate, ape, qsl, tables, ref_pool.indexer_q(1), ref_pool.indexer_scale(1), mode=mode,
                           round_scale=True)
    seed_tail_ring(k, gate, qsl, ring_ids, ref_pool.tail_ring(1), kpool=4)
    assert_pools_match(pool, ref_pool, 1, mode, entry_rule)


@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
def test_decode_step_with_drafts(force_triton, entry_rule, mode):
    gen = torch.Generator().manual_seed(4)
    lengths = [4, 1, 3, 2, 4, 11, 0]  # drafts; a single token; 11 tokens overrun the ring of 8
    starts = torch.tensor([13, 0, 62, 127, 6, 181, 40])  # 6..9 and 13..16 wrap around the ring
    k, gate = _keys(sum(lengths), gen)
    qsl = _qsl(lengths)
    ape = torch.randn(4, D, generator=gen)
    tables = torch.randperm(21, generator=gen).view(7, 3).to(torch.int32)
    tables[5, 2] = -1  # request 5's pools from position 128 have no block: skipped
    ring_ids = torch.tensor([2, 0, 3, 1, 5, 4, 6])
    pool, ref_pool = _pool(CONFIG, 21, 7, 2), _pool(CONFIG, 21, 7, 2)
    earlier = torch.randn(ref_pool.tail_ring(0).shape, generator=gen).to(torch.bfloat16)
    for ring in (pool.tail_ring(0), ref_pool.tail_ring(0)):
        ring.copy_(earlier)  # earlier steps' keys: finite (the reference's max propagates NaN, the kernel's not)
    args = (k, gate, starts, qsl, ring_ids, tables, ape)
    kpool_decode_update(*args, pool.tail_ring(0), pool.indexer_q(0), pool.indexer_scale(0), mode=mode)
    decode_update(*args, ref_pool.tail_ring(0), ref_pool.indexer_q(0), ref_pool.indexer_scale(0), mode=mode,
                  round_scale=True)
    assert_pools_match(pool, ref_pool, 0, mode, entry_rule)


def test_decode_refuses_ring_ids_out_of_range_on_cpu(force_triton):
    pool = _pool(CONFIG, 3, 2, 0)
    k = torch.zeros(1, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"ring_ids must lie in \[0, 2\), got range \[2, 2\]"):
        kpool_decode_update(k, k, torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([2]),
                            torch.zeros(1, 1, dtype=torch.int32), torch.zeros(4, D), pool.tail_ring(0),
                            pool.indexer_q(0), pool.indexer_scale(0))


def test_write_and_read_entries(force_triton):
    gen = torch.Generator().manual_seed(6)
    pool, ref_pool = _pool(CONFIG, 12, 2, 4), _pool(CONFIG, 12, 2, 4)
    q = torch.randn(37, D, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(37, generator=gen)
    slots = torch.randperm(12 * 16, generator=gen)[:37]
    slots[[3, 17]] = -1
    kpool_write_entries(pool.indexer_q(1), pool.indexer_scale(1), q, scale, slots)
    live = slots >= 0
    ref_pool.indexer_q(1)[slots[live] // 16, slots[live] % 16] = q[live]
    ref_pool.indexer_scale(1)[slots[live] // 16, slots[live] % 16] = scale[live]
    assert torch.equal(pool.blocks, ref_pool.blocks)
    got_q, got_scale = kpool_read_entries(pool.indexer_q(1), pool.indexer_scale(1), slots[live], dequantize=False)
    assert torch.equal(got_q.view(torch.uint8), q[live].view(torch.uint8)) and torch.equal(got_scale, scale[live])
    every_code = torch.arange(256, dtype=torch.uint8)
    every_code = every_code[(every_code & 0x7F) != 0x7F]  # every finite e4m3 value
    pool.indexer_q(0)[:2] = every_code.repeat(17)[: 2 * 16 * D].view(2, 16, D).view(torch.float8_e4m3fn)
    deq = kpool_read_entries(pool.indexer_q(0), pool.indexer_scale(0), torch.arange(32))
    assert torch.equal(deq, pool.indexer_q(0)[:2].reshape(-1, D).float() * pool.indexer_scale(0)[:2].reshape(-1, 1))


@pytest.mark.parametrize("heads", [1, 6, 17], ids=lambda h: f"H{h}")
def test_indexer_topk(force_triton, heads):
    gen = torch.Generator().manual_seed(7)
    pool = _pool(CONFIG, 12, 2, 5)
    pool.indexer_scale(0).copy_(torch.rand(12, 16, generator=gen) + 0.1)
    pool.indexer_q(0).copy_(torch.randn(12, 16, 128, generator=gen).to(torch.float8_e4m3fn))
    seq_lens = torch.tensor([3, 4, 70, 191])
    tables = torch.randperm(12, generator=gen).view(4, 3).to(torch.int32)
    q = torch.randn(4, heads, D, generator=gen).to(torch.bfloat16)
    weights = torch.randn(4, heads, generator=gen)
    for topk in (5, 60):
        pools, scores = kpool_indexer_topk(q, weights, seq_lens, tables, pool.indexer_q(0), pool.indexer_scale(0),
                                           kpool=4, topk=topk)
        ref_pools, ref_scores = indexer_topk(q, weights, seq_lens, tables, pool.indexer_q(0), pool.indexer_scale(0),
                                             kpool=4, topk=topk)
        assert torch.equal(pools < 0, ref_pools < 0)
        live = ref_pools >= 0
        tol = 1e-4 * float(ref_scores[live].abs().max().clamp_min(1.0))
        assert float((scores[live] - ref_scores[live]).abs().max()) <= tol
        swapped = (pools != ref_pools) & live
        assert bool(((scores - ref_scores).abs()[swapped] <= 2 * tol).all())  # only near-ties may swap


def _request(config: CacheConfig, max_tokens: int, seed: int):
    blocks = -(-max_tokens // config.block_size)
    pool = _pool(config, 2 * blocks + 1, 2, seed)
    table = torch.randperm(2 * blocks + 1, generator=torch.Generator().manual_seed(seed))[:blocks].view(1, -1)
    return pool, table.to(torch.int32)


def _snapshot(config: CacheConfig, pool: CachePool, table: torch.Tensor, length: int) -> tuple[bytes, bytes, bytes]:
    kpool, states = config.kpool, config.block_size // config.kpool
    pools = torch.arange(length // kpool)
    slots = table[0, pools * kpool // config.block_size].long() * states + pools % states
    q, scale = kpool_read_entries(pool.indexer_q(0), pool.indexer_scale(0), slots, dequantize=False)
    positions = torch.arange(length // kpool * kpool, length) % pool.tail_ring(0).shape[2]
    ring = pool.tail_ring(0)[1][:, positions]
    return q.view(torch.uint8).numpy().tobytes(), scale.numpy().tobytes(), ring.view(torch.int16).numpy().tobytes()


@pytest.mark.parametrize("kpool,num_spec,mode", [(4, 3, PoolMode.SOFTMAX), (2, 1, PoolMode.KEEP_LAST),
                                                 (8, 7, PoolMode.SOFTMAX)], ids=["kpool4-spec3", "kpool2-spec1",
                                                                                 "kpool8-spec7"])
def test_prefill_and_drafted_decode_give_the_same_bytes(force_triton, kpool, num_spec, mode):
    config = CacheConfig(kpool=kpool, num_spec=num_spec, block_size=16 * kpool, pool_mode=mode)
    gen = torch.Generator().manual_seed(kpool + num_spec)
    total = config.block_size + config.tail_ring.ring_size + 1
    k, gate = _keys(total, gen)
    ape = torch.randn(kpool, D, generator=gen)
    full_pool, full_table = _request(config, total + num_spec, 1)
    kpool_prefill(k, gate, ape, torch.tensor([0, total]), full_table, torch.tensor([1]), full_pool.indexer_q(0),
                  full_pool.indexer_scale(0), full_pool.tail_ring(0), mode=mode)
    pool, table = _request(config, total + num_spec, 2)
    prompt = kpool + 1
    kpool_prefill(k[:prompt], gate[:prompt], ape, torch.tensor([0, prompt]), table, torch.tensor([1]), pool.indexer_q(0),
                  pool.indexer_scale(0), pool.tail_ring(0), mode=mode)
    length = prompt
    while length < total:
        accepted = min(int(torch.randint(0, num_spec + 1, (1,), generator=gen)), total - length - 1)
        step_k, step_gate = _keys(1 + num_spec, gen)  # garbage for the rejected drafts
        step_k[: 1 + accepted], step_gate[: 1 + accepted] = k[length:length + 1 + accepted], gate[
            length:length + 1 + accepted]
        kpool_decode_update(step_k, step_gate, torch.tensor([length]), torch.tensor([0, 1 + num_spec]),
                            torch.tensor([1]), table, ape, pool.tail_ring(0), pool.indexer_q(0),
                            pool.indexer_scale(0), mode=mode)
        length += 1 + accepted
    assert _snapshot(config, pool, table, total) == _snapshot(config, full_pool, full_table, total)
