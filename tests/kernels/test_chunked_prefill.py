"""Chunked prefill writes the bytes of a whole prefill (DESIGN section 2, "Chunked prefill").

- the kpool prefill op, on its reference and its Triton kernel (interpreter): chunks that start and end
  anywhere, batched with another request's chunks, give the indexer entries and the open pool of one
  whole prefill;
- the engine, both families, drafts 0 to 7: a prompt prefilled in chunks (batched with another prompt's
  chunks) has the state digest and first token of the same prompt prefilled whole.

Chunk edges are drawn on and around every boundary: pools (groups), rings, kernel pages, blocks.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kpool_pd.kernels import kpool_prefill
from kpool_pd.kvcache import BlockLayout, CacheConfig, CacheFamily, CachePool, PoolMode
from kpool_pd.model import Engine, ModelConfig, PrefillJob
from tests.support.kernel_backends import ALL_BACKENDS, REFERENCE, Backend, backends, make_backend, poison

pytestmark = pytest.mark.usefixtures("one_torch_thread")
D = 128


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=False)


def edges_near(length: int, *periods: int) -> list[int]:
    """Positions in (0, length) on and one either side of every multiple of each period."""
    near = {m + d for p in periods for m in range(p, length + 1, p) for d in (-1, 0, 1)}
    return sorted(e for e in near if 0 < e < length)


def cuts(draw, length: int, periods: tuple[int, ...]) -> list[int]:
    """Sorted chunk edges inside (0, length): some near boundaries, some anywhere."""
    near = edges_near(length, *periods)
    pick = st.sampled_from(near) if near else st.nothing()
    anywhere = st.integers(1, length - 1) if length > 1 else st.nothing()
    chosen = draw(st.lists(st.one_of(pick, anywhere), max_size=6)) if length > 1 else []
    return sorted(set(chosen))


def chunks_of(length: int, edges: list[int]) -> list[tuple[int, int]]:
    bounds = [0, *edges, length]
    return list(zip(bounds, bounds[1:]))


# --- the op ------------------------------------------------------------------------------------------------


class OpRun:
    """Two requests' caches in one poisoned pool, prefilled through the public op (layer 0)."""

    def __init__(self, config: CacheConfig, lengths: list[int], seed: int, device: torch.device) -> None:
        self.config, self.device = config, device
        per = [-(-n // config.block_size) for n in lengths]
        self.pool = CachePool(BlockLayout(config), num_blocks=sum(per) + 1, num_rings=3, device=device)
        poison(self.pool.blocks, 7)
        poison(self.pool.rings, 8)
        order = torch.randperm(sum(per) + 1, generator=torch.Generator().manual_seed(seed)).tolist()
        width = max(per)
        self.tables = torch.full((len(lengths), width), -1, dtype=torch.int32)
        for b, n in enumerate(per):
            self.tables[b, :n] = torch.tensor(order[sum(per[:b]):sum(per[:b]) + n])
        self.ring_ids = torch.tensor([2, 0][:len(lengths)])

    def step(self, k, gate, ape, pieces: list[tuple[int, int, int]]) -> None:
        """One launch for ``pieces``: (request, start, end) chunks of the requests' keys."""
        rows = [torch.arange(s, e) + (0 if b == 0 else k[0].shape[0]) for b, s, e in pieces]
        both_k, both_g = torch.cat(k), torch.cat(gate)
        index = torch.cat(rows)
        qsl = torch.tensor([0] + torch.tensor([e - s for _, s, e in pieces]).cumsum(0).tolist(), dtype=torch.int32)
        req = [b for b, _, _ in pieces]
        kpool_prefill(both_k[index].to(self.device), both_g[index].to(self.device), ape.to(self.device),
                      qsl.to(self.device), self.tables[req].to(self.device), self.ring_ids[req].to(self.device),
                      self.pool.indexer_q(0), self.pool.indexer_scale(0), self.pool.tail_ring(0),
                      mode=self.config.pool_mode, round_scale=self.config.round_scale,
                      start_pos=torch.tensor([s for _, s, _ in pieces]).to(self.device))

    def state(self, b: int, length: int) -> tuple[bytes, bytes]:
        """Request b's blocks (all bytes: entries are the only ones written) and its ring's open pool."""
        blocks = self.pool.blocks[self.tables[b][self.tables[b] >= 0].long().to(self.device)]
        ring = self.pool.tail_ring(0)[int(self.ring_ids[b])]
        kpool = self.config.kpool
        slots = torch.arange(length // kpool * kpool, length, device=self.device) % ring.shape[1]
        return blocks.cpu().numpy().tobytes(), ring[:, slots].contiguous().view(torch.int16).cpu().numpy().tobytes()


def run_op(config: CacheConfig, lengths: list[int], edges: list[list[int]], device: torch.device, seed: int):
    """Whole prefill of both requests in one launch, then the chunked one (chunk i of every request that
    has one, per launch); returns both states of each request."""
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(n, D, generator=gen).to(torch.bfloat16) for n in lengths]
    gate = [(2 * torch.randn(n, D, generator=gen)).to(torch.bfloat16) for n in lengths]
    ape = torch.randn(config.kpool, D, generator=gen)
    whole, chunked = OpRun(config, lengths, seed, device), OpRun(config, lengths, seed, device)
    whole.step(k, gate, ape, [(b, 0, n) for b, n in enumerate(lengths)])
    plans = [chunks_of(n, e) for n, e in zip(lengths, edges)]
    for i in range(max(len(p) for p in plans)):
        chunked.step(k, gate, ape, [(b, *p[i]) for b, p in enumerate(plans) if i < len(p)])
    return [(whole.state(b, n), chunked.state(b, n)) for b, n in enumerate(lengths)]


OP_CASES = [(4, 3, PoolMode.SOFTMAX), (2, 0, PoolMode.KEEP_LAST), (8, 7, PoolMode.SOFTMAX), (4, 7, PoolMode.KEEP_LAST)]


@st.composite
def op_case(draw):
    kpool, num_spec, mode = draw(st.sampled_from(OP_CASES))
    config = CacheConfig(layer_names=("l0",), kpool=kpool, num_spec=num_spec, block_size=16 * kpool, pool_mode=mode)
    periods = (kpool, config.tail_ring.ring_size, config.block_size)
    lengths = [draw(st.integers(1, 2 * config.block_size + kpool + 1)) for _ in range(2)]
    return config, lengths, [cuts(draw, n, periods) for n in lengths]


@pytest.mark.parametrize("backend", backends(REFERENCE), indirect=True)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=op_case(), seed=st.integers(0, 2**16))
def test_op_chunks_anywhere_equal_one_whole_prefill(backend, case, seed):
    config, lengths, edges = case
    for b, (whole, chunked) in enumerate(run_op(config, lengths, edges, backend.device, seed)):
        assert chunked == whole, f"request {b} of {lengths}, chunk edges {edges[b]}"


KERNEL_CASES = [  # kpool, drafts, mode, lengths, chunk edges of each, block size (None: 16 * kpool), kernel page
    pytest.param(4, 3, PoolMode.SOFTMAX, [130, 70], [[3, 4, 5, 7, 8, 9, 63, 64, 65, 127], [1, 2, 66]], None, 64,
                 id="kpool4-pool-ring-block-edges"),
    pytest.param(8, 7, PoolMode.SOFTMAX, [137, 9], [[15, 16, 17, 127, 128, 129], [8]], None, 64, id="kpool8-spec7"),
    pytest.param(2, 0, PoolMode.KEEP_LAST, [35, 33], [[1, 3, 31, 32, 33], [2, 4, 5, 32]], None, 64,
                 id="kpool2-keep-last"),
    pytest.param(2, 3, PoolMode.KEEP_LAST, [300, 140], [[1, 127, 128, 129, 255, 256, 257], [63, 64, 65, 130]], 256,
                 32, id="kpool2-block256-four-pages-of-32-page-and-block-edges"),
]


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
@pytest.mark.parametrize("kpool,num_spec,mode,lengths,edges,block_size,page_states", KERNEL_CASES)
def test_kernel_chunks_equal_one_whole_prefill(backend, kpool, num_spec, mode, lengths, edges, block_size,
                                               page_states):
    config = CacheConfig(layer_names=("l0",), kpool=kpool, num_spec=num_spec, block_size=block_size or 16 * kpool,
                         pool_mode=mode, kernel_page_states=page_states)
    for b, (whole, chunked) in enumerate(run_op(config, lengths, edges, backend.device, kpool)):
        assert chunked == whole, f"request {b} of {lengths}, chunk edges {edges[b]}"


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
def test_a_chunk_inside_a_pool_reads_the_ring(backend):
    """The straddling pool is completed from the ring: a ring poisoned between two chunks changes it."""
    config = CacheConfig(layer_names=("l0",), kpool=4, num_spec=3, block_size=64)
    lengths, edges = [10], [[6]]
    (whole, chunked), = run_op(config, lengths, edges, backend.device, 1)
    assert chunked == whole
    gen = torch.Generator().manual_seed(1)
    k = [torch.randn(10, D, generator=gen).to(torch.bfloat16)]
    gate = [(2 * torch.randn(10, D, generator=gen)).to(torch.bfloat16)]
    ape = torch.randn(4, D, generator=gen)
    spoiled = OpRun(config, lengths, 1, backend.device)
    spoiled.step(k, gate, ape, [(0, 0, 6)])
    poison(spoiled.pool.tail_ring(0)[2], 99)  # positions 4, 5 of pool 1 are lost
    spoiled.step(k, gate, ape, [(0, 6, 10)])
    assert spoiled.state(0, 10)[0] != whole[0]


def test_a_chunk_inside_a_pool_without_a_ring_is_refused():
    pool = CachePool(BlockLayout(CacheConfig(layer_names=("l0",), kpool=4, num_spec=3, block_size=64)), num_blocks=2,
                     num_rings=1)
    k = torch.zeros(3, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="starts at position 5, inside a pool of 4: it needs a ring"):
        kpool_prefill(k, k, torch.zeros(4, D), torch.tensor([0, 3]), torch.tensor([[0]]), torch.tensor([-1]),
                      pool.indexer_q(0), pool.indexer_scale(0), pool.tail_ring(0), start_pos=torch.tensor([5]))
    with pytest.raises(ValueError, match="start_pos must have 1 rows"):
        kpool_prefill(k, k, torch.zeros(4, D), torch.tensor([0, 3]), torch.tensor([[0]]), torch.tensor([0]),
                      pool.indexer_q(0), pool.indexer_scale(0), pool.tail_ring(0), start_pos=torch.tensor([0, 3]))


# --- the engine ----------------------------------------------------------------------------------------------


def engine_for(config: ModelConfig, blocks: int) -> Engine:
    return Engine(config, CachePool(BlockLayout(config.cache), num_blocks=blocks, num_rings=4))


@st.composite
def engine_case(draw):
    family = draw(st.sampled_from(list(CacheFamily)))
    group = draw(st.sampled_from([2, 4] if family is CacheFamily.KPOOL else [1, 3, 4]))
    num_spec = draw(st.integers(0, 7))
    key = "kpool" if family is CacheFamily.KPOOL else "compress_ratio"
    config = ModelConfig.build(family=family, num_layers=2, num_spec=num_spec, **{key: group})
    cache = config.cache
    periods = (group, cache.ring_slots, cache.block_size)
    lengths = [draw(st.integers(1, 2 * cache.block_size + 2 * group + 1)) for _ in range(2)]
    return config, lengths, [cuts(draw, n, periods) for n in lengths]


def run_engine(config: ModelConfig, prompts: list[list[int]], edges: list[list[int]], seed: int):
    """The prompts prefilled whole in one forward and in chunks (chunk i of each prompt that has one, per
    forward, on other blocks in shuffled order); per prompt (whole, chunked) as (first token, state digest)."""
    per = [config.cache.blocks_for_tokens(len(p)) for p in prompts]
    engine = engine_for(config, 2 * sum(per))
    ids = list(range(2 * sum(per)))
    random.Random(seed).shuffle(ids)
    tables = [ids[sum(per[:b]):sum(per[:b + 1])] for b in range(len(prompts))]
    chunked_tables = [ids[sum(per) + sum(per[:b]):sum(per) + sum(per[:b + 1])] for b in range(len(prompts))]
    firsts = engine.prefill([PrefillJob(prompt=p, block_ids=t, ring_id=b) for b, (p, t) in enumerate(zip(prompts, tables))])
    plans = [chunks_of(len(p), e) for p, e in zip(prompts, edges)]
    chunk_firsts: list[int | None] = [None] * len(prompts)
    for i in range(max(len(p) for p in plans)):
        live = [b for b, p in enumerate(plans) if i < len(p)]
        got = engine.prefill([PrefillJob(prompt=prompts[b], block_ids=chunked_tables[b], ring_id=2 + b,
                                         start=plans[b][i][0], end=plans[b][i][1]) for b in live])
        for b, token in zip(live, got):
            assert (token is None) == (i < len(plans[b]) - 1), "only a prompt's last chunk gives a token"
            chunk_firsts[b] = token if token is not None else chunk_firsts[b]
    return [((firsts[b], engine.state_digest(tables[b], b, len(p))),
             (chunk_firsts[b], engine.state_digest(chunked_tables[b], 2 + b, len(p))))
            for b, p in enumerate(prompts)]


@settings(max_examples=40, deadline=None)
@given(case=engine_case(), seed=st.integers(0, 2**16))
def test_engine_chunks_equal_one_whole_prefill(case, seed):
    config, lengths, edges = case
    rng = random.Random(seed)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in lengths]
    for b, (whole, chunked) in enumerate(run_engine(config, prompts, edges, seed)):
        assert chunked == whole, f"{config.cache.family.value} prompt {b} of {lengths}, chunk edges {edges[b]}"


@pytest.mark.parametrize("family", [CacheFamily.KPOOL, CacheFamily.QSA], ids=lambda f: f.value)
def test_engine_chunk_outside_its_prompt_is_refused(family):
    engine = engine_for(ModelConfig.build(family=family, num_layers=1), 2)
    with pytest.raises(ValueError, match=r"chunk \[3, 3\) is empty or outside its 5-token prompt"):
        engine.prefill([PrefillJob(prompt=[1] * 5, block_ids=[0], ring_id=0, start=3, end=3)])
    with pytest.raises(ValueError, match=r"chunk \[2, 6\) is empty or outside"):
        engine.prefill([PrefillJob(prompt=[1] * 5, block_ids=[0], ring_id=0, start=2, end=6)])
