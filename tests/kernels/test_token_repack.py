"""Token-range repack (kernels.repack_tokens) between layouts that differ in block size, order and kernel page.

The expected bytes come from the pools' typed views (``CachePool.mla`` / ``indexer_q`` / ``indexer_scale`` /
``qsa_keys``, one logical order whatever the storage order), position by position: for every position
``p < n``, ``dst.mla(l)[dst_ids[p // B], p % B] == src.mla(l)[src_ids[p // A], p % A]``; for every kpool
state ``s < ceil(n / kpool)`` its entry and scale, and for every QSA group ``g < ceil(n / r)`` its row,
likewise. The destination is poisoned first and compared whole, so a byte written outside the range (other
blocks, rows past it, padding between pages) or left unwritten inside it fails. Every body runs on the
reference, in the Triton interpreter, and on CUDA (tests/gpu/test_kpool_gpu.py imports them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kpool_pd.kernels import block_ids_on, repack_tokens
from kpool_pd.kvcache import BlockLayout, BlockOrder, CacheConfig, CacheDtype, CacheFamily, CachePool
from tests.support.kernel_backends import ALL_BACKENDS, CUDA, INTERPRETER, REFERENCE, Backend, backends, make_backend, poison

BLNHC, BLHNC = BlockOrder.BLNHC, BlockOrder.BLHNC
LAYERS = ("l0", "l1")


@pytest.fixture
def backend(request, monkeypatch) -> Backend:
    return make_backend(request, monkeypatch, gpu_suite=False)


@dataclass(frozen=True)
class Side:
    block_size: int
    page_states: int = 64
    order: BlockOrder = BLNHC


@dataclass(frozen=True)
class Pair:
    """One cache (``base``) stored two ways."""

    base: dict
    src: Side
    dst: Side

    def config(self, side: Side) -> CacheConfig:
        return CacheConfig(layer_names=LAYERS, block_size=side.block_size, kernel_page_states=side.page_states,
                           order=side.order, **self.base)


KPOOL = CacheFamily.KPOOL
QSA = CacheFamily.QSA
PAIRS = {  # small MLA entries keep the interpreter fast; odd sizes exercise 1- and 2-byte words
    "kpool2-128to256-P64to32-NHCtoHNC": Pair(dict(family=KPOOL, kpool=2, mla_entry_bytes=24, mla_num_heads=2),
                                             Side(128, 64, BLNHC), Side(256, 32, BLHNC)),
    "kpool4-512to128-P32to64-odd-entry": Pair(dict(family=KPOOL, kpool=4, mla_entry_bytes=7, mla_num_heads=3),
                                              Side(512, 32, BLHNC), Side(128, 64, BLNHC)),
    "kpool8-256to512": Pair(dict(family=KPOOL, kpool=8, mla_entry_bytes=40), Side(256), Side(512)),
    "kpool8-64to192-P32to64": Pair(dict(family=KPOOL, kpool=8, mla_entry_bytes=16, mla_num_heads=2),
                                   Side(64, 32, BLHNC), Side(192, 64, BLNHC)),
    "kpool2-16to16-order-only": Pair(dict(family=KPOOL, kpool=2, mla_entry_bytes=12, mla_num_heads=2),
                                     Side(16, 64, BLNHC), Side(16, 64, BLHNC)),
    "kpool2-256to256-P64to32-page-only": Pair(dict(family=KPOOL, kpool=2, mla_entry_bytes=8),
                                              Side(256, 64), Side(256, 32)),
    "qsa-bf16-1head-128to256": Pair(dict(family=QSA, compress_ratio=4, mla_entry_bytes=24),
                                    Side(128, order=BLNHC), Side(256, order=BLHNC)),
    "qsa-fp8-2heads-512to128": Pair(dict(family=QSA, compress_ratio=8, qsa_head_size=64, qsa_num_heads=2,
                                         qsa_dtype=CacheDtype.FP8_E4M3, mla_entry_bytes=16, mla_num_heads=2),
                                    Side(512, order=BLHNC), Side(128, order=BLNHC)),
    "qsa-bf16-2heads-64to192": Pair(dict(family=QSA, compress_ratio=4, qsa_head_size=72, qsa_num_heads=2,
                                         mla_entry_bytes=20, mla_num_heads=2),
                                    Side(64, order=BLNHC), Side(192, order=BLHNC)),
    "qsa-fp8-1head-256to512-2byte-words": Pair(dict(family=QSA, compress_ratio=2, qsa_head_size=66,
                                                    qsa_dtype=CacheDtype.FP8_E4M3, mla_entry_bytes=10),
                                               Side(256, order=BLHNC), Side(512, order=BLHNC)),
    "qsa-bf16-2heads-16to16-order-only": Pair(dict(family=QSA, compress_ratio=4, qsa_head_size=64, qsa_num_heads=2,
                                                   mla_entry_bytes=20, mla_num_heads=2),
                                              Side(16, order=BLHNC), Side(16, order=BLNHC)),
}
EDGES = ["zero", "one", "entry-1", "src-block-1", "src-block+1", "dst-block-1", "dst-block+1", "full"]


def _capacity(pair: Pair) -> int:
    return 2 * max(pair.src.block_size, pair.dst.block_size)


def _edge(pair: Pair, edge: str) -> int:
    entry = pair.config(pair.src).tokens_per_entry
    a, b = pair.src.block_size, pair.dst.block_size
    return {"zero": 0, "one": 1, "entry-1": entry - 1, "src-block-1": a - 1, "src-block+1": a + 1,
            "dst-block-1": b - 1, "dst-block+1": b + 1, "full": _capacity(pair)}[edge]


def make_pool(config: CacheConfig, num_blocks: int, seed: int, device: torch.device) -> CachePool:
    pool = CachePool(BlockLayout(config), num_blocks=num_blocks, num_rings=1, device=device)
    poison(pool.blocks, seed)
    return pool


def shuffled_ids(count: int, pool_blocks: int, seed: int) -> list[int]:
    """``count`` distinct, non-contiguous ids in a random order."""
    return torch.randperm(pool_blocks, generator=torch.Generator().manual_seed(seed))[:count].tolist()


def expected_copy(src: CachePool, src_ids: list[int], want: CachePool, dst_ids: list[int], num_tokens: int) -> None:
    """Write into ``want`` (on the CPU), through the typed views, what the repack must write."""
    a, b = src.config.block_size, want.config.block_size
    per_entry = src.config.tokens_per_entry
    sid, did = torch.tensor(src_ids, dtype=torch.int64), torch.tensor(dst_ids, dtype=torch.int64)
    pos = torch.arange(num_tokens)
    entries = torch.arange(-(-num_tokens // per_entry))  # every pool / group whose first token is < n
    first = entries * per_entry
    src_block, dst_block = sid[first // a], did[first // b]
    src_entry, dst_entry = (first % a) // per_entry, (first % b) // per_entry
    for layer in LAYERS:
        want.mla(layer)[did[pos // b], pos % b] = src.mla(layer)[sid[pos // a], pos % a]
        if src.config.family is KPOOL:
            sp, dp = src.family_spec.states_per_page, want.family_spec.states_per_page
            src_at = (src_block, src_entry // sp, src_entry % sp)
            dst_at = (dst_block, dst_entry // dp, dst_entry % dp)
            want.indexer_q(layer).view(torch.uint8)[dst_at] = src.indexer_q(layer).view(torch.uint8)[src_at]
            want.indexer_scale(layer).view(torch.int32)[dst_at] = src.indexer_scale(layer).view(torch.int32)[src_at]
        else:
            bits = torch.uint8 if src.config.qsa_keys.element_bytes == 1 else torch.int16
            want.qsa_keys(layer).view(bits)[dst_block, dst_entry] = src.qsa_keys(layer).view(bits)[src_block, src_entry]


def check_repack(backend: Backend, pair: Pair, num_tokens: int, seed: int, *, tensor_ids: bool = True) -> None:
    """Repack ``num_tokens`` between shuffled block tables of ``pair`` and compare with ``expected_copy``."""
    src_config, dst_config = pair.config(pair.src), pair.config(pair.dst)
    capacity = _capacity(pair)
    src_count, dst_count = -(-capacity // pair.src.block_size), -(-capacity // pair.dst.block_size)
    src_ids, dst_ids = shuffled_ids(src_count, src_count + 3, seed), shuffled_ids(dst_count, dst_count + 3, seed + 1)
    cpu = torch.device("cpu")
    src = make_pool(src_config, src_count + 3, seed + 2, cpu)
    want = make_pool(dst_config, dst_count + 3, seed + 3, cpu)
    before = want.blocks.clone()
    expected_copy(src, src_ids, want, dst_ids, num_tokens)
    got = make_pool(dst_config, dst_count + 3, seed + 3, backend.device)
    src_blocks = src.blocks.to(backend.device)
    as_ids = (lambda ids: torch.tensor(ids, device=backend.device)) if tensor_ids else list
    repack_tokens(src_blocks, src.layout, as_ids(src_ids), got.blocks, got.layout, as_ids(dst_ids), num_tokens)
    result = got.blocks.cpu()
    wrong = (result != want.blocks).nonzero()
    assert wrong.numel() == 0, (f"{wrong.shape[0]} bytes differ from the view copy of {num_tokens} tokens, first at "
                                f"(block, byte) {wrong[:4].tolist()}")
    assert num_tokens == 0 or not torch.equal(result, before)  # something was copied: the check has teeth


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("name", list(PAIRS))
def test_repack_matches_view_copy(backend, name, edge):
    pair = PAIRS[name]
    check_repack(backend, pair, _edge(pair, edge), seed=len(name) * 31 + EDGES.index(edge))


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
def test_python_id_lists_and_longer_tables(backend):
    """Sequences of ints work as tensors do; a table longer than the tokens need is read only as far as needed."""
    pair = PAIRS["kpool8-64to192-P32to64"]
    check_repack(backend, pair, 130, seed=5, tensor_ids=False)
    check_repack(backend, pair, 64, seed=6)  # 1 of 6 source ids and 1 of 2 destination ids are read


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
def test_buffers_at_other_alignments_after_an_aligned_call(backend):
    """The Triton path works out each layout pair's launches once and keeps them; the words and 16-byte
    hints depend on the buffers' addresses, so buffers that start 1, 2 or 8 bytes past an aligned address,
    after a call on aligned ones, still get every byte right."""
    pair = PAIRS["kpool8-256to512"]
    src_config, dst_config = pair.config(pair.src), pair.config(pair.dst)
    src, want = make_pool(src_config, 3, 11, torch.device("cpu")), make_pool(dst_config, 3, 12, torch.device("cpu"))
    num_tokens = 300
    expected_copy(src, [2, 0], want, [1], num_tokens)
    for shift in (0, 1, 2, 8):
        def shifted(blocks: torch.Tensor) -> torch.Tensor:  # the same bytes, ``shift`` bytes past an aligned start
            raw = torch.empty(blocks.numel() + 16, dtype=torch.uint8, device=backend.device)
            assert raw.data_ptr() % 16 == 0
            view = raw[shift:shift + blocks.numel()].view(blocks.shape)
            view.copy_(blocks)
            return view
        src_blocks = shifted(src.blocks.to(backend.device))
        got = shifted(make_pool(dst_config, 3, 12, torch.device("cpu")).blocks.to(backend.device))
        assert (src_blocks.data_ptr() % 16, got.data_ptr() % 16) == (shift, shift)
        repack_tokens(src_blocks, src.layout, [2, 0], got, want.layout, [1], num_tokens)
        assert torch.equal(got.cpu(), want.blocks), f"bytes differ with buffers {shift} bytes past alignment"


ORDER_ONLY = {name: pair for name, pair in PAIRS.items() if pair.src.block_size == pair.dst.block_size
              and pair.src.page_states == pair.dst.page_states}
ORDER_ONLY["kpool4-256-NHCtoHNC"] = Pair(dict(family=KPOOL, kpool=4, mla_entry_bytes=24, mla_num_heads=4),
                                         Side(256, 64, BLNHC), Side(256, 64, BLHNC))
ORDER_ONLY["qsa-fp8-3heads-64-HNCtoNHC"] = Pair(dict(family=QSA, compress_ratio=2, qsa_head_size=64, qsa_num_heads=3,
                                                     qsa_dtype=CacheDtype.FP8, mla_entry_bytes=7, mla_num_heads=3),
                                                Side(64, order=BLHNC), Side(64, order=BLNHC))


@st.composite
def random_pairs(draw) -> tuple[Pair, int, int]:
    """A cache stored two ways (block sizes up to 256), a token count up to the capacity, a seed."""
    family = draw(st.sampled_from([KPOOL, QSA]))
    entry = draw(st.sampled_from([2, 4, 8]))
    heads = draw(st.sampled_from([1, 2]))
    base = dict(family=family, mla_entry_bytes=draw(st.sampled_from([5, 8, 12, 24])), mla_num_heads=heads)
    if family is KPOOL:
        base |= dict(kpool=entry)
    else:
        base |= dict(compress_ratio=entry, qsa_num_heads=heads, qsa_head_size=draw(st.sampled_from([64, 66, 96])),
                     qsa_dtype=draw(st.sampled_from([CacheDtype.BFLOAT16, CacheDtype.FP8_E4M3])))
    sides = []
    for _ in range(2):
        block_size = entry * draw(st.sampled_from([2, 4, 8, 16, 24, 32, 64]))
        states = block_size // entry
        pages = [p for p in (32, 64) if states <= p or states % p == 0] if family is KPOOL else [64]
        sides.append(Side(block_size, draw(st.sampled_from(pages)), draw(st.sampled_from([BLNHC, BLHNC]))))
    pair = Pair(base, *sides)
    return pair, draw(st.integers(0, _capacity(pair))), draw(st.integers(0, 1 << 16))


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=random_pairs())
def test_random_pairs_match_view_copy(backend, case):
    pair, num_tokens, seed = case
    check_repack(backend, pair, num_tokens, seed)


@pytest.mark.parametrize("backend", backends(CUDA), indirect=True)
@pytest.mark.parametrize("ids_on", ["device", "host ints"])
def test_device_ids_never_sync(backend, ids_on):
    """With the ids on the device, or given as ints (copied from pinned memory without waiting), the op never
    synchronises with the host (CUDA only: nothing syncs on CPU)."""
    pair = PAIRS["kpool4-512to128-P32to64-odd-entry"]
    src = make_pool(pair.config(pair.src), 3, 50, backend.device)
    dst = make_pool(pair.config(pair.dst), 9, 51, backend.device)
    src_ids, dst_ids = torch.tensor([2, 0], device=backend.device), torch.arange(8, device=backend.device)
    if ids_on == "host ints":
        src_ids, dst_ids = src_ids.tolist(), dst_ids.tolist()
    repack_tokens(src.blocks, src.layout, src_ids, dst.blocks, dst.layout, dst_ids, 1000)  # compiled here
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for n in (999, 1, 1024):  # other lengths reuse the compiled kernels
            repack_tokens(src.blocks, src.layout, src_ids, dst.blocks, dst.layout, dst_ids, n)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_repack(backend, pair, 1000, seed=52)


# Validation ------------------------------------------------------------------------------------------------
CHECKED = Pair(dict(family=QSA, compress_ratio=4, qsa_head_size=64, qsa_num_heads=2, mla_entry_bytes=20,
                    mla_num_heads=2), Side(16, order=BLNHC), Side(32, order=BLHNC))


def _args(device: torch.device) -> dict:
    """Valid arguments: 40 tokens from 3 source blocks of 16 into 2 destination blocks of 32."""
    src_layout, dst_layout = BlockLayout(CHECKED.config(CHECKED.src)), BlockLayout(CHECKED.config(CHECKED.dst))
    return {"src_blocks": torch.zeros(3, src_layout.block_bytes, dtype=torch.uint8, device=device),
            "src_layout": src_layout, "src_block_ids": [2, 0, 1],
            "dst_blocks": torch.zeros(3, dst_layout.block_bytes, dtype=torch.uint8, device=device),
            "dst_layout": dst_layout, "dst_block_ids": [1, 2], "num_tokens": 40}


def _other_layout(**changes) -> BlockLayout:
    return BlockLayout(dataclasses.replace(CHECKED.config(CHECKED.dst), **changes))


REJECTED = {  # id: (change the valid arguments, error, message)
    "layouts-differ-in-kpool-free-fields-not-named": (
        lambda a: a.update(dst_layout=_other_layout(compress_ratio=8, mla_entry_bytes=24)), ValueError,
        r"may differ only in \['block_size', 'order', 'kernel_page_states'\]; they also differ in "
        r"\['compress_ratio', 'mla_entry_bytes'\]"),
    "layouts-differ-in-layers": (lambda a: a.update(dst_layout=_other_layout(layer_names=("l0",))), ValueError,
                                 r"also differ in \['layer_names'\]"),
    "layouts-differ-in-family": (
        lambda a: a.update(dst_layout=_other_layout(family=KPOOL, kpool=2)), ValueError,
        r"also differ in \['family', 'kpool'\]"),
    "config-not-layout": (lambda a: a.update(src_layout=a["src_layout"].config), TypeError,
                          "src_layout must be a BlockLayout, got CacheConfig"),
    "src-not-a-tensor": (lambda a: a.update(src_blocks=a["src_blocks"].tolist()), TypeError,
                         "src_blocks must be a torch.Tensor, got list"),
    "int8-src": (lambda a: a.update(src_blocks=a["src_blocks"].to(torch.int8)), ValueError,
                 r"src_blocks must be contiguous uint8 \[num_blocks, block_bytes=\d+\], got torch.int8"),
    "narrow-dst": (lambda a: a.update(dst_blocks=a["dst_blocks"][:, 1:]), ValueError,
                   "dst_blocks must be contiguous uint8"),
    "strided-dst": (lambda a: a.update(dst_blocks=a["dst_blocks"][::2]), ValueError, r"with strides \(\d+, 1\)"),
    "dst-of-the-src-layout": (lambda a: a.update(dst_blocks=torch.zeros_like(a["src_blocks"])), ValueError,
                              "dst_blocks must be contiguous uint8"),
    "blocks-on-two-devices": (lambda a: a.update(dst_blocks=a["dst_blocks"].to("meta")), ValueError,
                              "src_blocks are on cpu, dst_blocks on meta"),
    "float-num-tokens": (lambda a: a.update(num_tokens=40.0), TypeError, "num_tokens must be an int, got float 40.0"),
    "bool-num-tokens": (lambda a: a.update(num_tokens=True), TypeError, "num_tokens must be an int, got bool"),
    "negative-num-tokens": (lambda a: a.update(num_tokens=-1), ValueError, "num_tokens must be >= 0, got -1"),
    "src-table-too-short": (lambda a: a.update(num_tokens=49), ValueError,
                            "src_block_ids hold 3 blocks of 16 tokens = 48 tokens, fewer than num_tokens 49"),
    "dst-table-too-short": (lambda a: a.update(dst_block_ids=[1]), ValueError,
                            "dst_block_ids hold 1 blocks of 32 tokens = 32 tokens, fewer than num_tokens 40"),
    "float-id-tensor": (lambda a: a.update(src_block_ids=torch.tensor([0.0, 1.0, 2.0])), ValueError,
                        r"src_block_ids must be a 1-D int32 or int64 tensor, got torch.float32 \[3\]"),
    "2d-id-tensor": (lambda a: a.update(dst_block_ids=torch.tensor([[1, 2]])), ValueError,
                     r"dst_block_ids must be a 1-D int32 or int64 tensor, got torch.int64 \[1, 2\]"),
    "ids-on-another-device": (lambda a: a.update(dst_block_ids=torch.tensor([1, 2], device="meta")), ValueError,
                              "dst_block_ids is on meta, the blocks on cpu"),
    "ids-a-string": (lambda a: a.update(src_block_ids="012"), TypeError,
                     "src_block_ids must be a tensor or a sequence of ints, got str"),
    "ids-with-a-float": (lambda a: a.update(dst_block_ids=[1, 2.0]), TypeError,
                         r"dst_block_ids must be a tensor or a sequence of ints, got \[1, 2.0\]"),
    "overlapping-buffers": (lambda a: a.update(src_layout=a["dst_layout"], src_blocks=a["dst_blocks"],
                                               src_block_ids=[0, 1]), ValueError, "overlap"),
}
HOST_CHECKED = {  # the id values, read on CPU tensors only (on CUDA a bad row is skipped)
    "src-id-past-pool": (lambda a: a.update(src_block_ids=[2, 3, 1]), ValueError,
                         r"src_block_ids must lie in \[0, 3\), got range \[1, 3\] in \[2, 3, 1\]"),
    "negative-dst-id": (lambda a: a.update(dst_block_ids=[-1, 2]), ValueError,
                        r"dst_block_ids must lie in \[0, 3\), got range \[-1, 2\]"),
    "dst-named-twice": (lambda a: a.update(dst_block_ids=[2, 2]), ValueError,
                        r"dst_block_ids name a block twice: \[2, 2\]"),
}


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
@pytest.mark.parametrize("case", list(REJECTED))
def test_rejects_bad_inputs(backend, case):
    change, error, match = REJECTED[case]
    args = _args(backend.device)
    change(args)
    if backend.is_cuda:  # the device checks name the CUDA device, not cpu
        match = match.replace("cpu", str(backend.device))
    with pytest.raises(error, match=match):
        repack_tokens(**args)


@pytest.mark.parametrize("backend", backends(REFERENCE, INTERPRETER), indirect=True)
@pytest.mark.parametrize("case", list(HOST_CHECKED))
def test_rejects_bad_ids_on_cpu(backend, case):
    change, error, match = HOST_CHECKED[case]
    args = _args(backend.device)
    change(args)
    with pytest.raises(error, match=match):
        repack_tokens(**args)


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
def test_valid_arguments_pass_and_unread_ids_are_not_checked(backend):
    """The validation cases start from arguments that pass (and move bytes); ids past what the tokens need are
    not read: 16 tokens with junk after the first id of each side land as with those first ids alone."""
    args = _args(backend.device)
    args["src_blocks"] = torch.randint(0, 256, args["src_blocks"].shape, dtype=torch.uint8,
                                       generator=torch.Generator().manual_seed(3)).to(backend.device)
    repack_tokens(**args)
    assert bool(args["dst_blocks"][[1, 2]].any()), "the valid arguments moved nothing"
    results = []
    for src_ids, dst_ids in (([2], [1]), ([2, 99, -5], [1, 1])):  # one block each side is read
        dst = torch.zeros_like(args["dst_blocks"])
        repack_tokens(**(args | {"num_tokens": 16, "src_block_ids": src_ids, "dst_block_ids": dst_ids, "dst_blocks": dst}))
        results.append(dst.cpu())
    assert bool(results[0][1].any()) and torch.equal(results[0], results[1])


@pytest.mark.parametrize("backend", backends(REFERENCE, CUDA), indirect=True)
def test_block_ids_on_the_device_are_the_ints(backend):
    table = block_ids_on([5, 0, 2**40], backend.device)
    assert table.dtype == torch.int64 and table.device.type == torch.device(backend.device).type
    assert table.cpu().tolist() == [5, 0, 2**40]


def _kernels_of(pair: Pair) -> list[str]:
    from kpool_pd.kernels.token_repack.triton import launch_plan

    src, dst = pair.config(pair.src), pair.config(pair.dst)
    plan = launch_plan(src, dst, BlockLayout(src).block_bytes, BlockLayout(dst).block_bytes, 0, 0, True)
    return [f"fused {len(launch.parts)}" if hasattr(launch, "parts") else launch.kernel.__name__ for launch in plan]


def test_run_fields_go_in_one_launch_others_one_a_field():
    """A kpool cache whose fields are all one-head runs on both sides (block sizes differ, order the same) is one
    launch of its three fields; where a field needs the rows kernel (two heads, orders differ) each field is its own."""
    assert _kernels_of(PAIRS["kpool8-256to512"]) == ["fused 3"]
    assert _kernels_of(PAIRS["kpool2-128to256-P64to32-NHCtoHNC"]) == ["_rows_kernel", "_runs_kernel", "_runs_kernel"]


@pytest.mark.parametrize("backend", backends(INTERPRETER, CUDA), indirect=True)
def test_fused_launch_writes_what_one_launch_a_field_writes(backend):
    """The fused launch and the per-field launches give the same bytes, the blocks around them untouched."""
    from kpool_pd.kernels.token_repack.triton import repack_tokens_triton

    pair = PAIRS["kpool8-256to512"]
    src_layout, dst_layout = BlockLayout(pair.config(pair.src)), BlockLayout(pair.config(pair.dst))
    src = torch.randint(0, 256, (4, src_layout.block_bytes), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(5)).to(backend.device)
    results = []
    for per_field in (False, True):
        dst = torch.full((4, dst_layout.block_bytes), 7, dtype=torch.uint8, device=backend.device)
        ids = torch.tensor([3, 0, 2, 1], device=backend.device), torch.tensor([2, 0], device=backend.device)
        repack_tokens_triton(src, src_layout, ids[0], dst, dst_layout, ids[1], 777, per_field=per_field)
        results.append(dst.cpu())
    assert torch.equal(results[0], results[1])
    assert bool((results[0][[1, 3]] == 7).all()) and bool((results[0][[0, 2]] != 7).any())
