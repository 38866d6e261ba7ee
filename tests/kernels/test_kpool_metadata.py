"""The kpool metadata (``kpool_pd.kernels.kpool_metadata``): the pool-granular slot mapping, complete pools and
kernel page table that the seed's builder emits for ``compress_ratio == kpool``, built once per step and taken
by the decode update (reference and Triton kernel), which then writes each pool where the metadata says."""

from __future__ import annotations

import pytest
import torch

from kpool_pd.kernels import kpool_decode_update
from kpool_pd.kernels.kpool_decode.ref import decode_update
from kpool_pd.kernels.kpool_metadata import KpoolMetadata, build_kpool_metadata
from kpool_pd.kvcache import CacheConfig, PoolMode
from kpool_pd.model import Engine, ModelConfig
from kpool_pd.model import kpool_family
from kpool_pd.model.engine import DecodeSequence, PrefillJob
from kpool_pd.kvcache import BlockLayout, CachePool
from tests.support.kernel_backends import KERNEL_BACKENDS, Backend, make_backend
from tests.kernels.test_kpool_triton import _qsl, keys, make_pool
from tests.support.allocations import placed

D = 128


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=False)


def _seed_slot(table: list[int], pos: int, *, kpool: int, block_size: int) -> int:
    """The seed's compressed slot for compress_ratio == kpool: block * (block_size // r) + (pos % block_size) // r
    where the token closes its group, else -1 (and -1 where the block is -1)."""
    column = pos // block_size
    block = table[column] if column < len(table) else -1
    if (pos + 1) % kpool or block < 0:
        return -1
    return block * (block_size // kpool) + (pos % block_size) // kpool


@pytest.mark.parametrize("kpool,block_size,pages", [(4, 64, 1), (2, 256, 2), (2, 256, 4)],
                         ids=["S16-one-page", "S128-two-pages", "S128-four-pages"])
def test_the_metadata_is_the_seeds_slot_mapping_seq_lens_and_page_table(kpool, block_size, pages):
    lengths, starts = [4, 1, 7, 2], [13, 0, block_size - 3, 2 * block_size - 1]
    table = torch.tensor([[5, 2, 9], [0, -1, -1], [7, 3, -1], [1, 4, 8]], dtype=torch.int32)
    table[3, 2] = -1  # request 3's last pools have no block: no slot
    qsl = _qsl(lengths, torch.device("cpu"))
    start = torch.tensor(starts, dtype=torch.int32)
    seq = start + torch.tensor(lengths, dtype=torch.int32)
    meta = build_kpool_metadata(qsl, start, seq, table, kpool=kpool, block_size=block_size, pages_per_block=pages)
    want = [_seed_slot(table[b].tolist(), starts[b] + i, kpool=kpool, block_size=block_size)
            for b in range(4) for i in range(lengths[b])]
    assert meta.slot_mapping.tolist() == want and meta.slot_mapping.dtype == torch.int64
    assert any(s >= 0 for s in want) and any(s < 0 for s in want)
    assert meta.seq_lens.tolist() == [int(n) // kpool for n in seq]
    assert meta.page_table.shape == (4, 3 * pages)
    assert meta.page_table[0].tolist() == [b * pages + j for b in (5, 2, 9) for j in range(pages)]
    assert meta.page_table[1, pages:].tolist() == [-1] * (2 * pages)
    with pytest.raises(ValueError, match=r"num_tokens 3 and seq_lens"):
        build_kpool_metadata(qsl, start, seq, table, kpool=kpool, block_size=block_size, num_tokens=3)
    with pytest.raises(ValueError, match="kpool must be an integer >= 2, got 1"):
        build_kpool_metadata(qsl, start, seq, table, kpool=1, block_size=block_size)


def _step(gen: torch.Generator, config: CacheConfig):
    """A decode step of 4 requests with drafts, crossing pools, a ring wrap and a block edge."""
    bs = config.block_size
    lengths, starts = [4, 1, 3, 4], [13, 0, bs - 2, 2 * bs - 1]
    k, gate = keys(sum(lengths), gen, torch.device("cpu"))
    qsl = _qsl(lengths, torch.device("cpu"))
    start = torch.tensor(starts, dtype=torch.int32)
    tables = torch.randperm(12, generator=gen).view(4, 3).to(torch.int32)
    ring_ids = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    ape = torch.randn(config.kpool, D, generator=gen)
    seq = start + torch.tensor(lengths, dtype=torch.int32)
    meta = build_kpool_metadata(qsl, start, seq, tables, kpool=config.kpool, block_size=bs,
                                pages_per_block=config.kpool_indexer.pages_per_block)
    return (k, gate, start, qsl, ring_ids, tables, ape), meta


@pytest.mark.parametrize("backend", KERNEL_BACKENDS, indirect=True)
def test_the_decode_update_writes_each_pool_at_the_metadatas_slot(backend):
    config = CacheConfig(layer_names=("l0",), block_size=64, kpool=4, num_spec=3)
    gen = torch.Generator().manual_seed(8)
    args, meta = _step(gen, config)
    device = backend.device
    on = lambda t: t.to(device)  # noqa: E731
    plain, mapped, ref = (make_pool(config, 12, 4, 3, d) for d in (device, device, torch.device("cpu")))
    earlier = torch.randn(ref.tail_ring(0).shape, generator=gen).to(torch.bfloat16)
    for pool in (plain, mapped, ref):
        pool.tail_ring(0).copy_(earlier)
    kpool_decode_update(*map(on, args), plain.tail_ring(0), plain.indexer_q(0), plain.indexer_scale(0),
                        mode=PoolMode.KEEP_LAST)
    kpool_decode_update(*map(on, args), mapped.tail_ring(0), mapped.indexer_q(0), mapped.indexer_scale(0),
                        mode=PoolMode.KEEP_LAST, metadata=_on(meta, device))
    assert torch.equal(plain.blocks.cpu(), mapped.blocks.cpu()) and torch.equal(plain.rings.cpu(), mapped.rings.cpu())
    # a slot mapping that sends every pool to its neighbour state (s ^ 1): the op writes where the metadata says
    moved = KpoolMetadata(**{**meta.__dict__, "slot_mapping": torch.where(meta.slot_mapping >= 0,
                                                                          meta.slot_mapping ^ 1, -1)})
    shifted = make_pool(config, 12, 4, 3, device)
    shifted.tail_ring(0).copy_(earlier)
    kpool_decode_update(*map(on, args), shifted.tail_ring(0), shifted.indexer_q(0), shifted.indexer_scale(0),
                        mode=PoolMode.KEEP_LAST, metadata=_on(moved, device))
    decode_update(*args, ref.tail_ring(0), ref.indexer_q(0), ref.indexer_scale(0), mode=PoolMode.KEEP_LAST,
                  round_scale=True, slot_mapping=moved.slot_mapping)
    assert torch.equal(shifted.blocks.cpu(), ref.blocks.cpu())
    assert not torch.equal(shifted.blocks.cpu(), plain.blocks.cpu())


def _on(meta: KpoolMetadata, device: torch.device) -> KpoolMetadata:
    fields = {name: value.to(device) if isinstance(value, torch.Tensor) else value
              for name, value in meta.__dict__.items()}
    return KpoolMetadata(**fields)


def test_the_metadata_of_a_fitting_step_is_refused_for_another():
    config = CacheConfig(layer_names=("l0",), block_size=64, kpool=4, num_spec=3)
    args, meta = _step(torch.Generator().manual_seed(1), config)
    pool = make_pool(config, 12, 4, 3, torch.device("cpu"))
    short = KpoolMetadata(**{**meta.__dict__, "slot_mapping": meta.slot_mapping[:-1]})
    with pytest.raises(ValueError, match=r"metadata of 11 tokens and 16 states a block does not fit a step of 12"):
        kpool_decode_update(*args, pool.tail_ring(0), pool.indexer_q(0), pool.indexer_scale(0), metadata=short)


def test_the_engine_builds_one_metadata_per_decode_step_for_every_layer(monkeypatch):
    config = ModelConfig.build(num_layers=3, kpool=4, num_spec=2, block_size=64)
    pool = CachePool(BlockLayout(config.cache), num_blocks=8, num_rings=2)
    engine = Engine(config, pool)
    built, taken = [], []
    real_build, real_update = kpool_family.build_kpool_metadata, kpool_family.kpool_decode_update
    monkeypatch.setattr(kpool_family, "build_kpool_metadata", lambda *a, **kw: built.append(real_build(*a, **kw))
                        or built[-1])
    monkeypatch.setattr(kpool_family, "kpool_decode_update", lambda *a, **kw: taken.append(kw["metadata"])
                        or real_update(*a, **kw))
    prompts = [list(range(1, 30)), list(range(5, 18))]
    firsts = engine.prefill([PrefillJob(prompt=p, block_ids=[2 * i, 2 * i + 1], ring_id=i) for i, p in enumerate(prompts)])
    sequences = [DecodeSequence(request_id=f"r{i}", prompt_len=len(p), max_tokens=5, allocation=placed(engine.pool, [2 * i, 2 * i + 1], i),
                                output=[firsts[i]]) for i, p in enumerate(prompts)]
    engine.decode_step(sequences)
    engine.decode_step(sequences)
    assert len(built) == 2 and len(taken) == 2 * 3  # one build a step, taken by each of the 3 layers
    assert all(m is built[0] for m in taken[:3]) and all(m is built[1] for m in taken[3:])
    assert built[0].slot_mapping.shape[0] == 2 * 3  # two requests, the last token and two drafts each
