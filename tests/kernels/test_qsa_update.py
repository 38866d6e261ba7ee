"""The QSA forward update and the QSA invariant (kernels.qsa_update).

The invariant: after any history of prefill chunks and decode steps with drafts (random
accepts and rejects, rejected drafts carrying garbage keys and positions), every complete
compressed row and the ring's open group (keys and packed positions) are byte-identical to
a single prefill of the committed sequence, which itself equals compressing each group of
the committed keys directly. The update's checks of its inputs: tests/kernels/test_qsa_update_checks.py.
"""

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kpool_pd.kernels.qsa_compress import compress_group_keys
from kpool_pd.kernels.qsa_metadata import build_qsa_metadata
from kpool_pd.kernels.qsa_ring import read_qsa_ring_positions, write_qsa_ring
from kpool_pd.kernels.qsa_rope import text_positions
from kpool_pd.kernels.qsa_update import qsa_forward_update
from kpool_pd.kvcache import (
    BlockLayout, BlockOrder, CacheConfig, CacheDtype, CacheFamily, CachePool,
    qsa_ring_capacity,
)
from tests.support.kernel_backends import ALL_BACKENDS, INTERPRETER, Backend, make_backend

HEAD_SIZE = 128
LAYER = "layer.1"  # the second layer, so page offsets matter


@dataclass(frozen=True)
class Storage:
    r: int
    num_spec: int
    rope: bool  # cache_rope_positions
    dtype: CacheDtype = CacheDtype.BFLOAT16
    order: BlockOrder = BlockOrder.BLNHC
    heads: int = 1

    @property
    def capacity(self) -> int:
        return qsa_ring_capacity(self.r, self.num_spec)

    def config(self) -> CacheConfig:
        return CacheConfig(
            family=CacheFamily.QSA, layer_names=("layer.0", LAYER), block_size=math.lcm(self.r, self.capacity),
            num_spec=self.num_spec, mla_entry_bytes=8, order=self.order, compress_ratio=self.r,
            qsa_head_size=HEAD_SIZE, qsa_num_heads=self.heads, qsa_dtype=self.dtype, cache_rope_positions=self.rope,
        )


@dataclass
class History:
    """One request: its committed keys and positions, and the pieces (one per forward) that build it."""

    keys: torch.Tensor  # [L, H, D] bf16
    positions: torch.Tensor  # [L, 3] int64
    pieces: list[tuple[int, torch.Tensor, torch.Tensor]]  # (first position, keys [q, H, D], positions [q, 3])


def random_positions(n: int, gen: torch.Generator) -> torch.Tensor:
    # Multimodal: the three axes differ, some beyond 2**32.
    return torch.randint(0, 2 ** 40, (n, 3), generator=gen)


def garbage_keys(n: int, heads: int, gen: torch.Generator) -> torch.Tensor:
    bits = torch.randint(-(2 ** 15), 2 ** 15, (n, heads, HEAD_SIZE), generator=gen, dtype=torch.int16)
    return bits.view(torch.bfloat16)  # any bit pattern, NaN and inf included


def make_history(chunks: list[int], steps: list[tuple[int, int]], storage: Storage, gen: torch.Generator) -> History:
    """Prefill ``chunks`` (token counts), then decode ``steps`` of (drafts, accepted drafts)."""
    length = sum(chunks) + sum(1 + accepted for _, accepted in steps)
    keys = torch.randn(length, storage.heads, HEAD_SIZE, generator=gen).to(torch.bfloat16)
    positions = random_positions(length, gen) if storage.rope else text_positions(torch.arange(length))
    pieces, cursor = [], 0
    for size in chunks:
        pieces.append((cursor, keys[cursor:cursor + size], positions[cursor:cursor + size]))
        cursor += size
    for drafts, accepted in steps:
        # The step's tokens: the last committed token, then the drafts; rejected ones are garbage.
        step_keys = garbage_keys(1 + drafts, storage.heads, gen)
        step_positions = random_positions(1 + drafts, gen)
        kept = 1 + accepted
        step_keys[:kept] = keys[cursor:cursor + kept]
        step_positions[:kept] = positions[cursor:cursor + kept]
        pieces.append((cursor, step_keys, step_positions))
        cursor += kept
    return History(keys, positions, pieces)


class Caches:
    """One worker's QSA caches for the test: a poisoned CachePool and the requests' tables (block ids handed
    out in order from ``next_block``, a ring per request in order of arrival: the kernels' addressing is
    under test here, not allocation)."""

    def __init__(
        self, storage: Storage, num_blocks: int, num_rings: int, *, seed: int, ring_capacity: int | None = None,
        device: str = "cpu",
    ):
        self.storage = storage
        self.device = device
        config = storage.config()
        self.spec = config.qsa_keys
        self.pool = CachePool(BlockLayout(config), num_blocks=num_blocks, num_rings=num_rings, device=device)
        gen = torch.Generator().manual_seed(seed)
        for buf in (self.pool.blocks, self.pool.rings):  # poison: unwritten bytes differ between runs
            buf.copy_(torch.randint(0, 256, buf.shape, generator=gen, dtype=torch.uint8))
        self.compressed = self.pool.qsa_keys(LAYER)
        self.ring = self.pool.qsa_ring(LAYER)
        self.capacity = storage.capacity
        if ring_capacity is not None:  # a ring of another size, outside the pool
            self.capacity = ring_capacity
            shape = (num_rings, ring_capacity, storage.heads, self.ring.shape[-1])
            self.ring = torch.randint(-(2 ** 15), 2 ** 15, shape, generator=gen, dtype=torch.int16).view(torch.bfloat16)
            self.ring = self.ring.to(device)
        self.next_block = 0
        self.rings: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}

    def forward(self, pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]], weight: torch.Tensor) -> None:
        """One forward over (request, first position, keys, positions) pieces."""
        block_size = self.spec.block_size
        starts, seq_lens, rings = [0], [], []
        for req, first, keys, _ in pieces:
            seq_len = first + keys.shape[0]
            if req not in self.tables:
                self.tables[req] = []
                self.rings[req] = len(self.rings)
            need = max(-(-seq_len // block_size) - len(self.tables[req]), 0)
            assert self.next_block + need <= self.pool.num_blocks, "the test's pool is too small"
            self.tables[req] += range(self.next_block, self.next_block + need)
            self.next_block += need
            starts.append(starts[-1] + keys.shape[0])
            seq_lens.append(seq_len)
            rings.append(self.rings[req])
        width = max(len(self.tables[req]) for req, *_ in pieces)
        table = [self.tables[req] + [-1] * (width - len(self.tables[req])) for req, *_ in pieces]
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=self.device)  # noqa: E731
        meta = build_qsa_metadata(
            i32(starts), i32(seq_lens), i32(table), i32(rings),
            compress_ratio=self.storage.r, ring_capacity=self.capacity, block_size=block_size,
        )
        keys = torch.cat([p[2] for p in pieces]).to(self.device)
        positions = torch.cat([p[3] for p in pieces]).to(self.device)
        qsa_forward_update(
            keys, positions, meta, self.ring, self.compressed, weight.to(self.device),
            compress_ratio=self.storage.r, block_size=block_size, eps=self.spec.norm_eps,
            rotary_dim=self.spec.rotary_dim, theta=self.spec.rope_theta, section=self.spec.mrope_section,
            cache_rope_positions=self.storage.rope,
        )

    def row_bits(self, req: int, group: int) -> torch.Tensor:
        rows = self.spec.rows_per_block
        block = self.tables[req][group * self.storage.r // self.spec.block_size]
        bits = torch.int16 if self.compressed.dtype == torch.bfloat16 else torch.uint8
        return self.compressed.view(bits)[block, group % rows]

    def ring_row(self, req: int, pos: int) -> torch.Tensor:
        return self.ring[self.rings[req], pos % self.capacity]

    def ring_positions(self, req: int, pos: int) -> torch.Tensor:
        slot = torch.tensor([pos % self.capacity])
        return read_qsa_ring_positions(self.ring, self.rings[req], slot, head_size=HEAD_SIZE)[0].cpu()


def expected_rows(history: History, caches: Caches, weight: torch.Tensor) -> torch.Tensor:
    """Every complete group of the committed sequence, compressed directly: [G, H, D] as bit patterns."""
    r, spec = caches.storage.r, caches.spec
    groups = history.keys.shape[0] // r
    keys = history.keys[:groups * r].view(groups, r, caches.storage.heads, HEAD_SIZE)
    device = caches.device
    rows = compress_group_keys(
        keys.to(device), history.positions[:groups * r:r].to(device), weight.to(device), eps=spec.norm_eps,
        rotary_dim=spec.rotary_dim, theta=spec.rope_theta, section=spec.mrope_section,
        out_dtype=caches.compressed.dtype,
    )
    return rows.view(torch.int16 if rows.dtype == torch.bfloat16 else torch.uint8)


def state_mismatches(caches: Caches, histories: list[History], weight: torch.Tensor) -> list[str]:
    """Where the caches differ from the committed sequences' true state (empty: the invariant holds)."""
    r = caches.storage.r
    bad = []
    for req, history in enumerate(histories):
        length = history.keys.shape[0]
        want = expected_rows(history, caches, weight)
        for g in range(length // r):
            if not torch.equal(caches.row_bits(req, g), want[g]):
                bad.append(f"request {req}: compressed row of group {g}")
        for pos in range(length // r * r, length):  # the ring's open group
            ring_key = caches.ring_row(req, pos)[:, :HEAD_SIZE].cpu()
            if not torch.equal(ring_key.view(torch.int16), history.keys[pos].view(torch.int16)):
                bad.append(f"request {req}: ring key of position {pos}")
            if caches.storage.rope and not torch.equal(caches.ring_positions(req, pos), history.positions[pos]):
                bad.append(f"request {req}: ring positions of position {pos}")
    return bad


def run_both(
    storage: Storage, histories: list[History], weight: torch.Tensor, *, ring_capacity: int | None = None,
    device: str = "cpu",
):
    """The committed sequences in one prefill, and piece by piece (requests batched per forward)."""
    longest = max(start + keys.shape[0] for h in histories for start, keys, _ in h.pieces)
    num_blocks = len(histories) * (-(-longest // storage.config().block_size)) + 2
    whole = Caches(storage, num_blocks, len(histories) + 1, seed=1, device=device)
    whole.next_block = 1  # so block ids differ between the runs
    whole.forward([(req, 0, h.keys, h.positions) for req, h in reversed(list(enumerate(histories)))], weight)
    stepped = Caches(storage, num_blocks, len(histories) + 1, seed=2, ring_capacity=ring_capacity, device=device)
    for step in range(max(len(h.pieces) for h in histories)):
        stepped.forward([(req, *h.pieces[step]) for req, h in enumerate(histories) if step < len(h.pieces)], weight)
    return whole, stepped


def norm_weight(seed: int) -> torch.Tensor:
    return torch.randn(HEAD_SIZE, generator=torch.Generator().manual_seed(seed)) * 0.5


@st.composite
def request_plans(draw, num_spec: int):
    chunks = draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))
    steps = draw(st.lists(
        st.integers(0, num_spec).flatmap(lambda drafts: st.tuples(st.just(drafts), st.integers(0, drafts))),
        max_size=8,
    ))
    return chunks, steps


def plans(num_spec: int):
    return st.lists(request_plans(num_spec), min_size=1, max_size=3)


@pytest.mark.parametrize("rope", [True, False], ids=["rope-cached", "text-rope"])
@pytest.mark.parametrize("num_spec", [0, 1, 3, 7], ids=lambda n: f"spec{n}")
@pytest.mark.parametrize("r", [1, 2, 4, 8], ids=lambda r: f"r{r}")
@settings(max_examples=8, deadline=None)
@given(
    dtype=st.sampled_from([CacheDtype.BFLOAT16, CacheDtype.FP8_E4M3]),
    order=st.sampled_from([BlockOrder.BLNHC, BlockOrder.BLHNC]),
    heads=st.sampled_from([1, 2]),
    data=st.data(),
    seed=st.integers(0, 2 ** 31),
)
def test_qsa_invariant(r, num_spec, rope, dtype, order, heads, data, seed):
    storage = Storage(r=r, num_spec=num_spec, rope=rope, dtype=dtype, order=order, heads=heads)
    gen = torch.Generator().manual_seed(seed)
    histories = [make_history(chunks, steps, storage, gen) for chunks, steps in data.draw(plans(num_spec))]
    weight = norm_weight(seed)
    whole, stepped = run_both(storage, histories, weight)
    assert state_mismatches(whole, histories, weight) == []
    assert state_mismatches(stepped, histories, weight) == []


EDGE_HISTORIES = {
    "single-token-prefill": (4, 3, [([1], [])]),
    "r1-single-tokens": (1, 0, [([1], [(0, 0)] * 5)]),
    "one-token-request-beside-a-long-one": (4, 3, [([1], [(3, 1)]), ([30], [(3, 3), (3, 0)])]),
    "ring-wraps-many-times": (2, 1, [([3], [(1, 1)] * 6 + [(1, 0)] * 6)]),
    "every-draft-rejected": (8, 7, [([9], [(7, 0)] * 6)]),
    "every-draft-accepted": (8, 7, [([7], [(7, 7)] * 4)]),
    "chunks-end-on-group-boundaries": (4, 3, [([4, 8, 4], [(3, 3)])]),
    "chunk-longer-than-ring-after-straddle": (4, 0, [([5, 10], [])]),
    "no-drafts-proposed": (4, 7, [([6], [(0, 0)] * 5)]),
}


STORAGE_KINDS = {
    "bf16-BLNHC-rope-cached": {"rope": True},
    "bf16-BLNHC-text-rope": {"rope": False},
    "fp8-BLHNC-2heads-rope-cached": {"rope": True, "dtype": CacheDtype.FP8_E4M3, "order": BlockOrder.BLHNC, "heads": 2},
}
INTERPRETED_HISTORIES = ("chunk-longer-than-ring-after-straddle", "every-draft-rejected",
                         "one-token-request-beside-a-long-one")


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=False)


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
@pytest.mark.parametrize("storage_kind", list(STORAGE_KINDS))
@pytest.mark.parametrize("case", list(EDGE_HISTORIES))
def test_edge_histories(backend, case, storage_kind):
    """The invariant over the edge histories, with every op on the backend: the reference, the kernels in the
    interpreter (three histories, fp8 rows: time) or compiled on CUDA."""
    if backend.name == INTERPRETER and (case not in INTERPRETED_HISTORIES
                                        or storage_kind != "fp8-BLHNC-2heads-rope-cached"):
        pytest.skip("the interpreter runs three histories on fp8 rows (time); the reference and CUDA run them all")
    r, num_spec, request_plans_ = EDGE_HISTORIES[case]
    storage = Storage(r=r, num_spec=num_spec, **STORAGE_KINDS[storage_kind])
    gen = torch.Generator().manual_seed(7)
    histories = [make_history(chunks, steps, storage, gen) for chunks, steps in request_plans_]
    weight = norm_weight(7)
    whole, stepped = run_both(storage, histories, weight, device=str(backend.device))
    assert state_mismatches(whole, histories, weight) == []
    assert state_mismatches(stepped, histories, weight) == []


@pytest.mark.parametrize("rope", [True, False], ids=["rope-cached", "text-rope"])
def test_teeth_a_ring_of_one_group_breaks_the_invariant(rope):
    # r = 4, num_spec = 3 needs C = 8. With C = 4: prefill 0..4 (the ring holds position 4 in
    # row 0); step 5..8 accepts one draft, and its rejected draft 8 overwrites row 0; the next
    # step closes group 1 (positions 4..7) and reads garbage for position 4.
    storage = Storage(r=4, num_spec=3, rope=rope)
    gen = torch.Generator().manual_seed(11)
    history = make_history([5], [(3, 1), (3, 0)], storage, gen)
    weight = norm_weight(11)
    _, right = run_both(storage, [history], weight)
    assert state_mismatches(right, [history], weight) == []
    _, too_small = run_both(storage, [history], weight, ring_capacity=4)
    assert state_mismatches(too_small, [history], weight) == ["request 0: compressed row of group 1"]


def test_teeth_writing_the_ring_first_breaks_a_straddling_group():
    # r = C = 4: the first chunk ends at position 4 (ring row 0); the second covers 5..14,
    # and its last C tokens 11..14 write rows 3, 0, 1, 2: position 12 replaces position 4,
    # which group 1 (positions 4..7) still needs.
    storage = Storage(r=4, num_spec=0, rope=True)
    gen = torch.Generator().manual_seed(5)
    history = make_history([5, 10], [], storage, gen)
    weight = norm_weight(5)
    caches = Caches(storage, num_blocks=8, num_rings=1, seed=3)
    caches.forward([(0, *history.pieces[0])], weight)
    first, keys, positions = history.pieces[1]
    ring_slots = torch.arange(first, first + keys.shape[0]) % 4
    ring_slots[: keys.shape[0] - 4] = -1
    write_qsa_ring(caches.ring, keys, positions, ring_slots)  # the wrong order: ring first
    caches.forward([(0, *history.pieces[1])], weight)
    assert state_mismatches(caches, [history], weight) == ["request 0: compressed row of group 1"]
