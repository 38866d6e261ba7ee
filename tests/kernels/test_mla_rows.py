"""The MLA row write (kernels.mla_rows): its Triton kernel against its reference, on both block orders'
views of a real pool, with tokens that have no block skipped; and its refusals."""

from __future__ import annotations

import pytest
import torch

from kpool_pd.kernels.mla_rows import write_mla_rows
from kpool_pd.kernels.mla_rows.ref import write_rows
from kpool_pd.kvcache import BlockLayout, BlockOrder, CacheFamily, CachePool
from kpool_pd.model import ModelConfig
from tests.support.kernel_backends import KERNEL_BACKENDS, Backend, make_backend


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=False)


def make_pool(order: BlockOrder, device: torch.device, *, num_blocks: int = 6) -> CachePool:
    config = ModelConfig.build(family=CacheFamily.KPOOL, num_layers=2, mla_entry_bytes=40, block_order=order).cache
    pool = CachePool(BlockLayout(config), num_blocks=num_blocks, num_rings=2, device=device)
    gen = torch.Generator().manual_seed(3)
    pool.blocks.copy_(torch.randint(0, 256, pool.blocks.shape, generator=gen, dtype=torch.int64).to(torch.uint8))
    return pool


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
@pytest.mark.parametrize("order", list(BlockOrder), ids=lambda o: o.value)
def test_kernel_writes_what_the_reference_writes(backend, order):
    pool, want = make_pool(order, backend.device), make_pool(order, torch.device("cpu"))
    mla = pool.mla(1)
    n = mla.shape[1]
    gen = torch.Generator().manual_seed(5)
    tokens = 50
    rows = torch.randperm(mla.shape[0] * n, generator=gen)[:tokens]  # distinct rows: no two writes meet
    blocks, offsets = rows // n, rows % n
    blocks[::7] = -1  # tokens without a block write nothing
    entries = torch.randint(0, 256, (tokens, mla.shape[3]), generator=gen, dtype=torch.int64).to(torch.uint8)
    write_mla_rows(mla, blocks.to(backend.device), offsets.to(backend.device), entries.to(backend.device))
    write_rows(want.mla(1), blocks, offsets, entries)
    assert torch.equal(pool.blocks.cpu(), want.blocks)
    written = want.mla(1)[blocks[blocks >= 0], offsets[blocks >= 0]]
    assert torch.equal(written, entries[blocks >= 0][:, None, :].expand_as(written))


def test_refusals_name_the_values():
    pool = make_pool(BlockOrder.BLNHC, torch.device("cpu"))
    mla = pool.mla(0)
    entries = torch.zeros(2, mla.shape[3], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"blocks must lie in \[-1, 6\).*\[0, 9\]"):
        write_mla_rows(mla, torch.tensor([0, 9]), torch.tensor([0, 1]), entries)
    with pytest.raises(ValueError, match="one row per token, got 1, 2 and 2"):
        write_mla_rows(mla, torch.tensor([0]), torch.tensor([0, 1]), entries)
    with pytest.raises(ValueError, match="entries must have shape"):
        write_mla_rows(mla, torch.tensor([0, 1]), torch.tensor([0, 1]), entries[:, :3])
