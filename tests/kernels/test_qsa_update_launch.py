"""The forward update's launches (kernels.qsa_update.launch): every grid and size writes the reference's bytes.

Each body runs the Triton update with one ``UpdateLaunch`` and the torch reference on the same inputs (the
interpreter here, compiled through tests/gpu/test_qsa_gpu.py) and compares every byte of the pool. The batch has
a decode-like request whose group straddles the chunk (its older keys and first position in the ring), a
single-token request, a request without tokens, and a chunk longer than the ring whose straddling group's last
token has no ring slot: with the grid of one program per request, that chunk's group tiles loop and its ring
writes reach the rows its straddling group reads (the barrier's case). The RopeCache is the doctored one of
tests/kernels/test_qsa_triton.py holding every position drawn, so the interpreter's rows are exact too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kpool_pd.kernels import build_qsa_metadata
from kpool_pd.kernels.qsa_update import ref as update_ref
from kpool_pd.kernels.qsa_metadata.split import split_uniform_decodes
from kpool_pd.kernels.qsa_update.launch import UpdateGrid, UpdateLaunch, default_update_launch
from kpool_pd.kernels.qsa_update.triton import qsa_forward_update_triton
from kpool_pd.kvcache import BlockOrder, CacheDtype
from tests.support.kernel_backends import KERNEL_BACKENDS, Backend, make_backend
from tests.kernels.test_qsa_triton import ROPE, TABLE_POSITIONS, qsa_pool, table_for

PER_REQUEST = UpdateGrid.REQUESTS
LAUNCHES = [UpdateLaunch(block=1, num_warps=1), UpdateLaunch(block=4, num_warps=4), UpdateLaunch(block=4, num_warps=2),
            UpdateLaunch(block=2, num_warps=1, paired=False), UpdateLaunch(block=1, num_warps=1, pdl=False),
            UpdateLaunch(grid=PER_REQUEST, block=1, num_warps=1), UpdateLaunch(grid=PER_REQUEST, block=2, num_warps=4),
            UpdateLaunch(grid=PER_REQUEST, block=4, num_warps=1, paired=False),
            UpdateLaunch(grid=PER_REQUEST, block=1, num_warps=2, pdl=False)]


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=False)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda launch: launch.label)
@pytest.mark.parametrize("dtype, heads, rope", [(CacheDtype.BFLOAT16, 1, True), (CacheDtype.FP8_E4M3, 2, True),
                                                (CacheDtype.BFLOAT16, 2, False)],
                         ids=["bf16-1head-rope-cached", "fp8-2heads-rope-cached", "bf16-2heads-text-rope"])
def test_every_launch_writes_the_reference_bytes(backend, launch, dtype, heads, rope):
    r, num_spec = 4, 3
    q_lens = [4, 1, 13, 0, 3]  # 13 > C = 8: tokens 0..4 of that chunk have no ring slot
    seq = [23, 8, 30, 9, 16]  # chunks from 19, 7, 17, 9, 13: the first group of each but request 3 straddles
    requests = len(q_lens)
    device = backend.device
    pools = [qsa_pool(dtype, BlockOrder.BLNHC, heads, r, num_spec, blocks=requests * 4, rings=requests + 1, seed=9,
                      device=device) for _ in range(2)]
    got_pool, want_pool = pools
    cap, block_size = got_pool.config.qsa_ring.capacity, got_pool.config.block_size
    gen = torch.Generator().manual_seed(21)
    ring = got_pool.qsa_ring("l1")  # older keys finite, packed positions the table holds
    ring[..., :128].copy_(torch.randn(ring.shape[:3] + (128,), generator=gen).to(torch.bfloat16))
    ring[..., 128:].view(torch.int64).copy_(torch.randint(0, TABLE_POSITIONS, ring.shape[:3] + (3,), generator=gen))
    want_pool.rings.copy_(got_pool.rings)
    table = torch.randperm(requests * 4, generator=gen).view(requests, 4).to(torch.int32)
    rings = torch.tensor([3, 0, 5, 1, 2], dtype=torch.int32)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    tokens = sum(q_lens)
    meta = build_qsa_metadata(starts.to(device), torch.tensor(seq, dtype=torch.int32, device=device),
                              table.to(device), rings.to(device), compress_ratio=r, ring_capacity=cap,
                              block_size=block_size, num_tokens=tokens)
    keys = (torch.randn(tokens, heads, 128, generator=gen) * 2).to(torch.bfloat16).to(device)
    positions = torch.randint(0, TABLE_POSITIONS, (tokens, 3), generator=gen).to(device)
    weight = (torch.randn(128, generator=gen) * 0.5).to(device)
    rope_cache = table_for("held", device)
    qsa_forward_update_triton(keys, positions, meta, got_pool.qsa_ring("l1"), got_pool.qsa_keys("l1"), weight,
                              eps=1e-6, cache_rope_positions=rope, rope_cache=rope_cache, launch=launch, **ROPE)
    update_ref.qsa_forward_update(keys, positions, meta, want_pool.qsa_ring("l1"), want_pool.qsa_keys("l1"), weight,
                                  compress_ratio=r, block_size=block_size, eps=1e-6, cache_rope_positions=rope,
                                  rope_cache=rope_cache, **ROPE)
    assert int(meta.num_work[0]) == 6  # 1 + 1 + 3 + 0 + 1 groups
    assert torch.equal(got_pool.rings, want_pool.rings)
    differ = int((got_pool.blocks != want_pool.blocks).sum())
    assert differ == 0, f"{differ} bytes of the compressed rows differ ({launch.label})"


@pytest.mark.parametrize("r, cap", [(1, 1), (2, 2), (2, 3), (4, 4), (4, 8), (8, 15)], ids=lambda v: str(v))
def test_the_barrier_rule_covers_every_ring_row_read_and_written(r, cap):
    """The per-request grid orders a request's ring writes after its ring reads with a barrier only where
    ``seq - 1 - (start // r) * r >= C`` (kernels/qsa_update/per_request.py): below that, no ring row its groups
    read (positions (start // r) * r to start) is one its ring write writes (its last C positions)."""
    barrier_needed = 0
    for start in range(3 * cap + r):
        for q_len in range(1, 3 * cap):
            seq, first = start + q_len, (start // r) * r
            read = {pos % cap for pos in range(first, start)}
            written = {pos % cap for pos in range(max(start, seq - cap), seq)}
            if seq - 1 - first < cap:
                assert not read & written, f"start {start}, {q_len} tokens: rows {sorted(read & written)}"
            barrier_needed += bool(read & written)
    assert barrier_needed or r == 1  # the rule is not vacuous: longer chunks do meet their reads (r 1 reads none)


def decode_metadata(q_lens: list[int], seq: list[int], *, split: bool, r: int = 4, cap: int = 8):
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    meta = build_qsa_metadata(starts, seq_lens, torch.zeros(len(q_lens), 4, dtype=torch.int32),
                              torch.arange(len(q_lens), dtype=torch.int32), compress_ratio=r, ring_capacity=cap,
                              block_size=16)
    if not split:
        return meta
    return dataclasses.replace(meta, split=split_uniform_decodes(starts, seq_lens, decode_threshold=4))


@pytest.mark.parametrize("q_lens, split, want", [
    ([4, 4, 4], True, UpdateLaunch(grid=PER_REQUEST, block=1, num_warps=1)),  # 4 tokens, r 4: one group
    ([4, 5, 1], True, UpdateLaunch(grid=PER_REQUEST, block=2, num_warps=1)),  # 5 tokens can complete two
    ([4, 4, 4], False, UpdateLaunch(grid=PER_REQUEST, block=2, num_warps=1)),  # no host counts: up to C = 8 tokens
    ([4, 9, 1], True, UpdateLaunch(block=4, num_warps=4)),  # a request longer than C: two launches
    ([30, 1, 1], False, UpdateLaunch(block=4, num_warps=4)),  # more tokens than requests x C
], ids=["uniform-decode", "mixed-short", "decode-without-split", "one-chunk-past-the-ring", "prefill"])
def test_the_default_launch_on_the_cpu(q_lens, split, want):
    meta = decode_metadata(q_lens, [q + 8 for q in q_lens], split=split)
    assert default_update_launch(metadata=meta, device=torch.device("cpu")) == want


def test_launch_options_are_checked():
    with pytest.raises(ValueError, match="block must be a power of two >= 1, got 3"):
        UpdateLaunch(block=3)
    with pytest.raises(ValueError, match="num_warps must be one of"):
        UpdateLaunch(num_warps=3)
    with pytest.raises(ValueError, match="grid must be an UpdateGrid, got 'per request'"):
        UpdateLaunch(grid="per request")
