"""QSA scoring and top-k's Triton kernels against their torch references, each body once, on every
backend that runs kernels: Triton's CPU interpreter here, compiled on CUDA through
tests/gpu/test_qsa_gpu.py (tests/support/kernel_backends.py).

Rules: with integer-valued rows and queries every product and sum is exact, so rows and token
indices are identical; with random values, scores within 1e-5 relative of the reference's (fp32
accumulation order) and the same rows except near-ties.
"""

from __future__ import annotations

import math

import pytest
import torch

from kpool_pd.kernels import qsa_topk
from kpool_pd.kernels.qsa_score import ref as score_ref
from kpool_pd.kernels.qsa_score.triton import qsa_scores_triton
from kpool_pd.kvcache import CacheDtype
from tests.support.kernel_backends import KERNEL_BACKENDS, Backend, make_backend


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=False)



def score_inputs(dtype: CacheDtype, integer: bool, seed: int, backend: Backend):
    """A BLHNC cache and queries: in the interpreter 5 queries over 7 small blocks (a request with no visible
    row, one with no tokens); compiled, 48 queries of 16 heads over 400 blocks of 64 tokens."""
    gen = torch.Generator().manual_seed(seed)
    r, block_size, kv_heads, head_size, blocks, queries, q_heads = backend.pick((4, 16, 2, 64, 7, 5, 4),
                                                                               (4, 64, 2, 128, 400, 48, 16))
    cache = torch.empty(blocks, kv_heads, block_size // r, head_size, dtype=dtype.torch_dtype).permute(0, 2, 1, 3)
    values = torch.randint(-3, 4, cache.shape, generator=gen) if integer else torch.randn(cache.shape, generator=gen)
    cache.copy_(values.to(cache.dtype))
    q = (torch.randint(-3, 4, (queries, q_heads, head_size), generator=gen) if integer
         else torch.randn(queries, q_heads, head_size, generator=gen)).to(torch.bfloat16)
    if backend.is_cuda:
        table = torch.randperm(blocks, generator=gen)[:queries * 8].view(queries, 8).to(torch.int32)
        seq_lens = torch.randint(0, 8 * block_size + 1, (queries,), generator=gen).to(torch.int32)
    else:
        table = torch.tensor([[0, 1, 2], [3, 4, -1], [5, -1, -1], [6, 2, 1], [1, -1, -1]], dtype=torch.int32)
        seq_lens = torch.tensor([45, 30, 3, 48, 0], dtype=torch.int32)  # 11, 7, 0, 12 and 0 visible rows
    return q, cache, table, seq_lens, {"compress_ratio": r, "block_size": block_size}


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [CacheDtype.BFLOAT16, CacheDtype.FP8_E4M3], ids=lambda d: d.value)
@pytest.mark.parametrize("topk", [1, 4, 20, 200], ids=lambda k: f"top{k}")
def test_topk_exact_on_integer_values(backend, dtype, topk):
    q, cache, table, seq_lens, params = score_inputs(dtype, True, 1, backend)
    if topk == 20:  # one int dtype rule: tables and lengths may be int32 or int64
        table, seq_lens = table.to(torch.int64), seq_lens.to(torch.int64)
    rows, tokens = qsa_topk(*(t.to(backend.device) for t in (q, cache, table, seq_lens)), **params, topk=topk)
    want_rows, want_tokens = score_ref.qsa_topk(q, cache, table, seq_lens, **params, topk=topk)
    assert torch.equal(rows.cpu(), want_rows) and torch.equal(tokens.cpu(), want_tokens)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [CacheDtype.BFLOAT16, CacheDtype.FP8_E4M3], ids=lambda d: d.value)
def test_scores_within_accumulation_error(backend, dtype):
    q, cache, table, seq_lens, params = score_inputs(dtype, False, 2, backend)
    r, block_size = params["compress_ratio"], params["block_size"]
    on_device = tuple(t.to(backend.device) for t in (q, cache, table, seq_lens))
    scores = qsa_scores_triton(*on_device, **params).cpu()
    rows, _ = qsa_topk(*on_device, **params, topk=12)
    rows = rows.cpu()
    want_rows, _ = score_ref.qsa_topk(q, cache, table, seq_lens, **params, topk=12)
    assert torch.equal(rows < 0, want_rows < 0)
    group = q.shape[1] // cache.shape[2]
    for b, visible in enumerate((seq_lens // r).tolist()):
        assert bool(torch.isinf(scores[b, visible:]).all())
        j = torch.arange(visible)
        k = cache[table[b, j * r // block_size].long(), j % (block_size // r)].float().repeat_interleave(group, dim=1)
        want = torch.relu((q[b].float()[None] * k).sum(-1)).sum(-1) / math.sqrt(q.shape[2])  # [J]
        assert bool(((scores[b, :visible] - want).abs() <= 1e-5 * want.abs().clamp_min(1.0)).all())
        for i in torch.nonzero(rows[b] != want_rows[b]).flatten().tolist():  # only a near-tie may swap
            a, c = float(scores[b, rows[b, i]]), float(scores[b, want_rows[b, i]])
            assert abs(a - c) <= 2e-5 * max(1.0, abs(c))


def test_topk_checks_values_on_cpu(force_triton):
    q, cache, table, seq_lens, params = score_inputs(CacheDtype.BFLOAT16, True, 3,
                                                     Backend("interpreter", torch.device("cpu")))
    table[0, 1] = 9
    with pytest.raises(ValueError, match="block 9, outside the cache's blocks"):
        qsa_topk(q, cache, table, seq_lens, **params, topk=2)
