"""Per-forward QSA metadata (kernels.qsa_metadata)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kpool_pd.kernels.qsa_metadata import QsaMetadata, build_qsa_metadata, max_work_items
from kpool_pd.kvcache import qsa_ring_capacity


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def build(q_lens, seq_lens, block_table, ring_blocks, *, r, cap, block_size):
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return build_qsa_metadata(
        i32(starts), i32(seq_lens), i32(block_table), i32(ring_blocks),
        compress_ratio=r, ring_capacity=cap, block_size=block_size,
    )


def brute_force(q_lens, seq_lens, block_table, ring_blocks, *, r, cap, block_size):
    """Token by token, straight from the definitions."""
    out = {key: [] for key in ("req", "pos", "visible", "ring", "compressed")}
    work = []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        start = seq_len - q_len
        for i in range(q_len):
            pos = start + i
            out["req"].append(b)
            out["pos"].append(pos)
            out["visible"].append(min((pos + 1) // r, seq_len // r))
            out["ring"].append(ring_blocks[b] * cap + pos % cap if i >= q_len - cap else -1)
            if (pos + 1) % r == 0:
                g = pos // r
                rows = block_size // r
                out["compressed"].append(block_table[b][g * r // block_size] * rows + g % rows)
                work.append((b, g - start // r))
            else:
                out["compressed"].append(-1)
    return out, work


def check_against_brute_force(q_lens, seq_lens, block_table, ring_blocks, *, r, cap, block_size):
    meta = build(q_lens, seq_lens, block_table, ring_blocks, r=r, cap=cap, block_size=block_size)
    want, work = brute_force(q_lens, seq_lens, block_table, ring_blocks, r=r, cap=cap, block_size=block_size)
    assert meta.token_to_req.dtype == torch.int32 and meta.token_to_req.tolist() == want["req"]
    assert meta.logical_positions.dtype == torch.int64 and meta.logical_positions.tolist() == want["pos"]
    assert meta.visible_blocks.dtype == torch.int32 and meta.visible_blocks.tolist() == want["visible"]
    assert meta.ring_slot_mapping.dtype == torch.int64 and meta.ring_slot_mapping.tolist() == want["ring"]
    assert meta.compressed_slot_mapping.dtype == torch.int64
    assert meta.compressed_slot_mapping.tolist() == want["compressed"]
    max_work = max_work_items(sum(q_lens), len(q_lens), r)
    assert len(work) <= max_work  # the static bound holds
    assert meta.k_work.dtype == torch.int32 and meta.k_work.shape == (max_work, 2)
    assert meta.k_work.tolist() == [list(w) for w in work] + [[-1, -1]] * (max_work - len(work))
    assert meta.num_work.dtype == torch.int32 and meta.num_work.tolist() == [len(work)]
    slots = [s for s in want["ring"] if s >= 0]
    assert len(slots) == len(set(slots))  # two tokens never alias a ring row
    return meta


def test_hand_example():
    # r = 4, C = 8, block_size = 8 (2 rows a block). Request 0: a 10-token prefill into
    # ring 1 (q_len > C: its first two tokens get no ring row). Request 1: a decode step
    # at positions 3..6 (one token plus three drafts) into ring 0; position 3 closes group 0.
    meta = build([10, 4], [10, 7], [[5, 2], [3, -1]], [1, 0], r=4, cap=8, block_size=8)
    assert meta.token_to_req.tolist() == [0] * 10 + [1] * 4
    assert meta.logical_positions.tolist() == list(range(10)) + [3, 4, 5, 6]
    assert meta.visible_blocks.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2] + [1, 1, 1, 1]
    assert meta.ring_slot_mapping.tolist() == [-1, -1, 10, 11, 12, 13, 14, 15, 8, 9] + [3, 4, 5, 6]
    assert meta.compressed_slot_mapping.tolist() == [-1, -1, -1, 10, -1, -1, -1, 11, -1, -1] + [6, -1, -1, -1]
    assert meta.k_work.tolist() == [[0, 0], [0, 1], [1, 0], [-1, -1], [-1, -1]]
    assert meta.num_work.tolist() == [3]
    assert "requests=2" in repr(meta) and isinstance(meta, QsaMetadata)


@pytest.mark.parametrize(
    "q_lens, seq_lens, r, cap",
    [
        ([1], [1], 4, 4),
        ([1], [4], 4, 4),
        ([1], [8], 1, 1),
        ([3, 1, 1], [3, 9, 1], 2, 4),
        ([0, 2], [5, 2], 2, 2),
        ([20], [27], 4, 8),
        ([5], [13], 4, 12),
    ],
    ids=["single-token", "single-token-closes-group", "r1-single-token", "one-token-requests",
         "idle-request", "long-chunk-ring-wraps", "straddling-chunk"],
)
def test_edge_shapes(q_lens, seq_lens, r, cap):
    block_size = 4 * r
    blocks = [-(-s // block_size) for s in seq_lens]
    width = max(blocks)
    table, next_id = [], 0
    for n in blocks:
        table.append(list(range(next_id, next_id + n)) + [-1] * (width - n))
        next_id += n
    check_against_brute_force(q_lens, seq_lens, table, list(range(len(q_lens))), r=r, cap=cap, block_size=block_size)


@pytest.mark.parametrize("r", [2, 4, 8], ids=lambda r: f"r{r}")
def test_work_bound_is_reached(r):
    # Each chunk starts one token before a group boundary and holds one token: every
    # request completes one group, which is what (T + (r - 1) * B) // r allows.
    meta = build([1, 1, 1], [r, 2 * r, 3 * r], [[0, 1, 2]] * 3, [0, 1, 2], r=r, cap=r, block_size=r)
    assert meta.num_work.tolist() == [3] == [meta.k_work.shape[0]]


@st.composite
def batches(draw):
    r = draw(st.sampled_from([1, 2, 3, 4, 8]))
    cap = qsa_ring_capacity(r, draw(st.integers(0, 7)))
    block_size = r * draw(st.integers(1, 4))
    num_requests = draw(st.integers(1, 4))
    seq_lens = [draw(st.integers(0, 70)) for _ in range(num_requests)]
    q_lens = [draw(st.one_of(st.just(min(1, s)), st.integers(0, s))) for s in seq_lens]
    blocks = [-(-s // block_size) for s in seq_lens]
    width = max(blocks) + draw(st.integers(0, 2))
    ids = draw(st.permutations(range(sum(blocks) + 3)))
    table, used = [], 0
    for n in blocks:
        table.append(list(ids[used:used + n]) + [-1] * (width - n))
        used += n
    ring_blocks = list(draw(st.permutations(range(num_requests + 2))))[:num_requests]
    return q_lens, seq_lens, table, ring_blocks, r, cap, block_size


@settings(max_examples=60, deadline=None)
@given(batches())
def test_matches_brute_force(batch):
    q_lens, seq_lens, table, ring_blocks, r, cap, block_size = batch
    check_against_brute_force(q_lens, seq_lens, table, ring_blocks, r=r, cap=cap, block_size=block_size)


def test_empty_forward():
    meta = build_qsa_metadata(
        i32([0, 0]), i32([5]), i32([[0, 1]]), i32([0]), compress_ratio=4, ring_capacity=4, block_size=4
    )
    assert meta.num_tokens == 0 and meta.num_work.tolist() == [0] and meta.k_work.shape == (0, 2)


GOOD = {"qsl": i32([0, 2, 3]), "seq": i32([4, 9]), "table": i32([[0, 1, -1], [2, 3, 4]]), "rings": i32([0, 1])}


@pytest.mark.parametrize(
    "change, params, match",
    [
        ({"seq": i32([1, 9])}, {}, r"request 0: q_len 2 > seq_len 1"),
        ({"seq": i32([4, 13])}, {}, r"request 1: seq_len 13 needs 4 blocks of 4, but block_table has 3 columns"),
        ({"qsl": i32([0, 3, 2])}, {}, r"not monotone: entry 1 = 3 > entry 2 = 2"),
        ({"qsl": i32([1, 2, 3])}, {}, "start at 0, got 1"),
        ({"qsl": i32([0, 3])}, {}, "expected B \\+ 1 = 3"),
        ({"qsl": torch.tensor([0.0, 2.0, 3.0])}, {}, "query_start_loc must be int32 or int64, got torch.float32"),
        ({"table": i32([0, 1, 2])}, {}, r"block_table must have rank 2, got shape \(3,\)"),
        ({"table": i32([[0, 1, -1]])}, {}, "B = 2 rows"),
        ({"table": i32([[-1, 1, -1], [2, 3, 4]])}, {}, r"request 0: block_table column 0 holds block -1"),
        ({"rings": i32([0, -1])}, {}, "request 1: ring block -1"),
        ({}, {"compress_ratio": 3}, "block_size 4 is not a multiple of compress_ratio 3"),
        ({}, {"ring_capacity": 2, "compress_ratio": 4}, "ring_capacity 2 < compress_ratio 4"),
        ({}, {"block_size": 0}, "block_size must be a positive integer, got 0"),
    ],
    ids=["q-longer-than-seq", "table-too-short", "non-monotone", "offset-start", "qsl-length", "float-qsl",
         "1d-table", "table-rows", "negative-block-used", "negative-ring", "block-not-multiple-of-r",
         "ring-smaller-than-group", "zero-block-size"],
)
def test_rejects_bad_inputs(change, params, match):
    args = GOOD | change
    kwargs = {"compress_ratio": 2, "ring_capacity": 4, "block_size": 4} | params
    with pytest.raises(ValueError, match=match):
        build_qsa_metadata(args["qsl"], args["seq"], args["table"], args["rings"], **kwargs)


def test_int64_inputs_give_the_int32_metadata():
    """One int dtype rule for every op: index tensors may be int32 or int64 (the metadata holds int32)."""
    kwargs = {"compress_ratio": 2, "ring_capacity": 4, "block_size": 4}
    narrow = build_qsa_metadata(GOOD["qsl"], GOOD["seq"], GOOD["table"], GOOD["rings"], **kwargs)
    wide = build_qsa_metadata(*(GOOD[k].to(torch.int64) for k in ("qsl", "seq", "table", "rings")), **kwargs)
    for name in ("query_start_loc", "seq_lens", "block_table", "ring_blocks", "token_to_req", "logical_positions",
                 "visible_blocks", "ring_slot_mapping", "compressed_slot_mapping", "k_work", "num_work"):
        a, b = getattr(wide, name), getattr(narrow, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    args = ([0, 10, 14], [10, 7], [[5, 2], [3, -1]], [1, 0])
    params = {"compress_ratio": 4, "ring_capacity": 8, "block_size": 8}
    cpu = build_qsa_metadata(*(i32(a) for a in args), **params)
    gpu = build_qsa_metadata(*(i32(a).cuda() for a in args), **params)
    for name in ("token_to_req", "logical_positions", "visible_blocks", "ring_slot_mapping",
                 "compressed_slot_mapping", "k_work", "num_work"):
        assert getattr(gpu, name).is_cuda and torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
