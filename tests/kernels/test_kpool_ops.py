"""kpool paged write/read, batched prefill and decode, and indexer scoring against brute force."""

from __future__ import annotations

import pytest
import torch

from kpool_pd.kernels import kpool_decode_update, kpool_indexer_topk, kpool_prefill, kpool_read_entries, kpool_write_entries
from kpool_pd.kernels.kpool_compress.ref import compress_pools
from kpool_pd.kvcache import BlockLayout, CacheConfig, CachePool, PoolMode

CONFIG = CacheConfig(layer_names=("l0", "l1"), block_size=64, kpool=4, num_spec=3)


def _pool(seed: int = 0) -> CachePool:
    pool = CachePool(BlockLayout(CONFIG), num_blocks=12, num_rings=4)
    pool.blocks.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    return pool


def test_write_then_read_round_trips_and_skips_minus_one():
    pool = _pool()
    before = pool.blocks.clone()
    q = torch.randn(3, 128).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.5, 2.0, 4.0])
    slots = torch.tensor([5 * 16 + 3, -1, 11 * 16 + 15])
    kpool_write_entries(pool.indexer_q(1), pool.indexer_scale(1), q, scale, slots)
    got_q, got_scale = kpool_read_entries(pool.indexer_q(1), pool.indexer_scale(1), slots[[0, 2]], dequantize=False)
    assert torch.equal(got_q.view(torch.uint8), q[[0, 2]].view(torch.uint8))
    assert got_scale.tolist() == [0.5, 4.0]
    dequant = kpool_read_entries(pool.indexer_q(1), pool.indexer_scale(1), slots[[0]])
    assert torch.equal(dequant, q[[0]].to(torch.float32) * 0.5)
    changed = (pool.blocks != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [5, 11]  # slot -1 wrote nothing, layer 0 untouched


def test_slots_out_of_range_are_refused():
    pool = _pool()
    with pytest.raises(ValueError, match=r"slots must lie in \[-1, 192\), got range \[-1, 192\]"):
        kpool_write_entries(pool.indexer_q(0), pool.indexer_scale(0), torch.zeros(2, 128).to(torch.float8_e4m3fn),
                            torch.ones(2), torch.tensor([-1, 192]))


def _batch(lengths: list[int], gen: torch.Generator):
    total = sum(lengths)
    k = torch.randn(total, 128, generator=gen).to(torch.bfloat16)
    gate = torch.randn(total, 128, generator=gen).to(torch.bfloat16)
    qsl = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return k, gate, qsl


@pytest.mark.parametrize("mode", list(PoolMode), ids=lambda m: m.value)
def test_batched_prefill_equals_each_request_alone(mode):
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 4, 67, 130, 7]
    k, gate, qsl = _batch(lengths, gen)
    ape = torch.randn(4, 128, generator=gen)
    perm = torch.randperm(12, generator=gen)
    tables = torch.stack([perm[:3], perm[3:6], perm[6:9], perm[9:12], perm[[0, 4, 8]]]).to(torch.int32)
    tables[4] = torch.tensor([-1, -1, -1])  # a request whose pools must not be written
    batched = _pool(1)
    kpool_prefill(k, gate, ape, qsl, tables, torch.tensor([0, 1, 2, 3, -1]), batched.indexer_q(0),
                  batched.indexer_scale(0), batched.tail_ring(0), mode=mode)
    alone = _pool(1)
    for b in range(4):
        sl = slice(int(qsl[b]), int(qsl[b + 1]))
        kpool_prefill(k[sl], gate[sl], ape, torch.tensor([0, lengths[b]]), tables[b:b + 1], torch.tensor([b]),
                      alone.indexer_q(0), alone.indexer_scale(0), alone.tail_ring(0), mode=mode)
    assert torch.equal(batched.blocks, alone.blocks)
    assert torch.equal(batched.rings, alone.rings)
    # pool 16 of request 3 (positions 64..67) sits in block tables[3][1], state 0; it matches a direct compression
    pools = k[int(qsl[3]) + 64:int(qsl[3]) + 68][None], gate[int(qsl[3]) + 64:int(qsl[3]) + 68][None]
    q, scale = compress_pools(*pools, ape, mode=mode, round_scale=True)
    assert torch.equal(batched.indexer_q(0)[tables[3, 1].item(), 0, 0].view(torch.uint8), q[0].view(torch.uint8))
    assert batched.indexer_scale(0)[tables[3, 1].item(), 0, 0].item() == scale.item()
    # request 3 (130 tokens) left positions 128, 129 in its ring at slots 0, 1 (R = 8)
    assert torch.equal(batched.tail_ring(0)[3, 0, :2], k[int(qsl[3]) + 128:int(qsl[3]) + 130])


def test_batched_decode_step_equals_each_request_alone():
    gen = torch.Generator().manual_seed(4)
    lengths = [4, 1, 3, 2]
    starts = torch.tensor([13, 0, 62, 127])
    k, gate, qsl = _batch(lengths, gen)
    ape = torch.randn(4, 128, generator=gen)
    tables = torch.randperm(12, generator=gen)[:12].view(4, 3).to(torch.int32)
    batched, alone = _pool(2), _pool(2)
    ring_ids = torch.tensor([2, 0, 3, 1])
    kpool_decode_update(k, gate, starts, qsl, ring_ids, tables, ape, batched.tail_ring(1),
                        batched.indexer_q(1), batched.indexer_scale(1))
    for b in range(4):
        sl = slice(int(qsl[b]), int(qsl[b + 1]))
        kpool_decode_update(k[sl], gate[sl], starts[b:b + 1], torch.tensor([0, lengths[b]]), ring_ids[b:b + 1],
                            tables[b:b + 1], ape, alone.tail_ring(1), alone.indexer_q(1), alone.indexer_scale(1))
    assert torch.equal(batched.blocks, alone.blocks) and torch.equal(batched.rings, alone.rings)
    # request 0 covers positions 13..16: position 15 completes pool 3 -> block tables[0][0], state 3
    assert not torch.equal(batched.blocks, _pool(2).blocks)


def test_decode_refuses_mismatched_rows():
    pool = _pool()
    k = torch.zeros(2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"start_pos must have 1 rows .* got shape \(2,\)"):
        kpool_decode_update(k, k, torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([0]),
                            torch.zeros(1, 2, dtype=torch.int32), torch.zeros(4, 128), pool.tail_ring(0),
                            pool.indexer_q(0), pool.indexer_scale(0))


def test_indexer_topk_matches_brute_force():
    gen = torch.Generator().manual_seed(5)
    pool = _pool(5)
    pool.indexer_scale(0).copy_((torch.rand(12, 16, generator=gen) + 0.1).view(12, 1, 16))
    pool.indexer_q(0).copy_(torch.randn(12, 16, 128, generator=gen).to(torch.float8_e4m3fn).view(12, 1, 16, 128))
    seq_lens = torch.tensor([3, 4, 70, 191])
    tables = torch.randperm(12, generator=gen).view(4, 3).to(torch.int32)
    q = torch.randn(4, 6, 128, generator=gen).to(torch.bfloat16)
    weights = torch.randn(4, 6, generator=gen)
    pools, scores = kpool_indexer_topk(q, weights, seq_lens, tables, pool.indexer_q(0), pool.indexer_scale(0),
                                       kpool=4, topk=5)
    for b, length in enumerate(seq_lens.tolist()):
        brute = []
        for p in range(length // 4):
            block, state = tables[b, p * 4 // 64].item(), p % 16
            key = pool.indexer_q(0)[block, 0, state].to(torch.float64) * pool.indexer_scale(0)[block, 0, state].item()
            s = sum(weights[b, h].item() * max(0.0, float(q[b, h].to(torch.float64) @ key)) for h in range(6))
            brute.append((s, p))
        want = sorted(brute, key=lambda sp: (-sp[0], sp[1]))[:5]
        got = [(scores[b, i].item(), pools[b, i].item()) for i in range(5) if pools[b, i] >= 0]
        assert [p for _, p in got] == [p for _, p in want]
        assert all(abs(a - w) <= 1e-3 * max(1.0, abs(w)) for (a, _), (w, _) in zip(got, want))
    assert pools[0].tolist() == [-1] * 5 and pools[1].tolist()[1:] == [-1] * 4


def test_indexer_topk_skips_pools_without_a_block():
    gen = torch.Generator().manual_seed(6)
    pool = _pool(6)
    pool.indexer_scale(0).copy_((torch.rand(12, 16, generator=gen) + 0.1).view(12, 1, 16))
    pool.indexer_q(0).copy_(torch.randn(12, 16, 128, generator=gen).to(torch.float8_e4m3fn).view(12, 1, 16, 128))
    table = torch.tensor([[3, -1]], dtype=torch.int32)  # pools 16..31 have no block; 32.. lie past the table
    pools, scores = kpool_indexer_topk(torch.randn(1, 2, 128, generator=gen).to(torch.bfloat16), torch.ones(1, 2),
                                       torch.tensor([200]), table, pool.indexer_q(0), pool.indexer_scale(0),
                                       kpool=4, topk=40)
    chosen = pools[0][pools[0] >= 0].tolist()
    assert len(chosen) == 16 and set(chosen) == set(range(16))
    assert torch.isinf(scores[0, 16:]).all()
