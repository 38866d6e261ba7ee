"""The forward update's launches (kernels.qsa_update.launch): every size writes the reference's bytes.

Each body runs the Triton update with one ``UpdateLaunch`` and the torch reference on the same inputs (the
interpreter here, compiled through tests/gpu/test_qsa_gpu.py) and compares every byte of the pool. The batch has
a decode-like request whose group straddles the chunk (its older keys and first position in the ring), a
single-token request, a request without tokens, and a chunk longer than the ring whose straddling group's last
token has no ring slot. The RopeCache is the doctored one of tests/test_qsa_triton.py holding every position
drawn, so the interpreter's rows are exact too.
"""

from __future__ import annotations

import pytest
import torch

from kpool_pd.kernels import build_qsa_metadata
from kpool_pd.kernels.qsa_update import ref as update_ref
from kpool_pd.kernels.qsa_update.launch import UpdateLaunch, default_update_launch
from kpool_pd.kernels.qsa_update.triton import qsa_forward_update_triton
from kpool_pd.kvcache import BlockOrder, CacheDtype
from tests.kernel_backends import KERNEL_BACKENDS, Backend, make_backend
from tests.test_qsa_triton import ROPE, TABLE_POSITIONS, qsa_pool, table_for

LAUNCHES = [UpdateLaunch(block=1, num_warps=1), UpdateLaunch(block=4, num_warps=4), UpdateLaunch(block=4, num_warps=2),
            UpdateLaunch(block=2, num_warps=1, paired=False), UpdateLaunch(block=1, num_warps=1, pdl=False)]


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


def test_the_default_launch_on_the_cpu():
    assert default_update_launch(max_work=45, device=torch.device("cpu")) == UpdateLaunch(block=4, num_warps=4)


def test_launch_options_are_checked():
    with pytest.raises(ValueError, match="block must be a power of two >= 1, got 3"):
        UpdateLaunch(block=3)
    with pytest.raises(ValueError, match="num_warps must be one of"):
        UpdateLaunch(num_warps=3)
