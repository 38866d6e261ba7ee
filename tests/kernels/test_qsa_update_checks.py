"""The QSA forward update's checks of its inputs (kernels.qsa_update): a small valid call, and each
bad argument refused with an error that names it (the invariant: tests/kernels/test_qsa_update.py)."""

import pytest
import torch

from kpool_pd.kernels.qsa_metadata import build_qsa_metadata
from kpool_pd.kernels.qsa_update import qsa_forward_update
from tests.kernels.test_qsa_update import HEAD_SIZE, Caches, Storage


def small_call(**change):
    """A valid update of a 3-token prefill (r = 2, C = 2, block_size = 2), with ``change`` applied.

    ``table`` and ``rings`` replace the metadata's block table and ring blocks.
    """
    storage = Storage(r=2, num_spec=0, rope=True)
    caches = Caches(storage, num_blocks=2, num_rings=1, seed=0)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    meta = build_qsa_metadata(
        i32([0, 3]), i32([3]), i32(change.pop("table", [[1, 0]])), i32(change.pop("rings", [0])),
        compress_ratio=2, ring_capacity=2, block_size=2,
    )
    compress_ratio = change.pop("compress_ratio", 2)
    cache_rope_positions = change.pop("cache_rope_positions", True)
    args = {
        "keys": torch.zeros(3, 1, HEAD_SIZE, dtype=torch.bfloat16),
        "positions": torch.zeros(3, 3, dtype=torch.int64),
        "metadata": meta,
        "ring": caches.ring,
        "compressed": caches.compressed,
        "norm_weight": torch.zeros(HEAD_SIZE),
    } | change
    qsa_forward_update(
        *args.values(), compress_ratio=compress_ratio, block_size=2, eps=1e-6, rotary_dim=64,
        theta=10000.0, section=(12, 10, 10), cache_rope_positions=cache_rope_positions,
    )
    return caches


def test_small_call_is_valid():
    caches = small_call()  # zero keys: group 0's row (block 1) is all zeros; block 0 keeps its poison
    assert not caches.compressed[1, 0].view(torch.int16).any()
    assert caches.compressed[0, 0].view(torch.int16).any()


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"compress_ratio": 1}, ValueError, "differ from the metadata"),
        ({"keys": torch.zeros(2, 1, HEAD_SIZE, dtype=torch.bfloat16)}, ValueError, r"keys must be bf16 \[T=3"),
        ({"positions": torch.zeros(3, 3, dtype=torch.int32)}, ValueError, "positions must be int64"),
        ({"ring": torch.zeros(1, 2, 1, HEAD_SIZE, dtype=torch.bfloat16)}, ValueError, r"off \+ 12 = 140"),
        ({"ring": torch.zeros(1, 2, 1, 100, dtype=torch.bfloat16), "cache_rope_positions": False}, ValueError,
         "too narrow"),
        ({"ring": torch.zeros(1, 4, 1, 140, dtype=torch.bfloat16)}, ValueError, "C=2"),
        ({"compressed": torch.zeros(2, 2, 1, HEAD_SIZE, dtype=torch.bfloat16)}, ValueError, "rows=1"),
        ({"compressed": torch.zeros(2, 1, 1, HEAD_SIZE, dtype=torch.float16)}, ValueError, "bf16 or fp8_e4m3"),
        ({"norm_weight": torch.zeros(HEAD_SIZE, dtype=torch.float64)}, ValueError, "norm_weight"),
        ({"rings": [4]}, ValueError, r"ring_blocks \[4\] reach past the 1 rings"),
        ({"table": [[9, 0]]}, ValueError, r"reach past the cache's 2 blocks"),
        ({"metadata": "not metadata"}, TypeError, "QsaMetadata"),
    ],
    ids=["ratio-mismatch", "token-count", "int32-positions", "ring-without-position-room", "ring-too-narrow",
         "ring-capacity", "compressed-rows", "fp16-cache", "fp64-weight", "ring-past-end", "block-past-end",
         "not-metadata"],
)
def test_rejects_bad_inputs(change, error, match):
    with pytest.raises(error, match=match):
        small_call(**change)


def test_rejects_two_groups_in_one_row():
    # Two requests whose tables share block 1: both groups 0 map to compressed slot 1.
    caches = Caches(Storage(r=2, num_spec=0, rope=False), num_blocks=2, num_rings=2, seed=0)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    meta = build_qsa_metadata(i32([0, 2, 4]), i32([2, 2]), i32([[1], [1]]), i32([0, 1]),
                              compress_ratio=2, ring_capacity=2, block_size=2)
    with pytest.raises(ValueError, match=r"two groups of this forward map to one compressed row: slots \[1, 1\]"):
        qsa_forward_update(
            torch.zeros(4, 1, HEAD_SIZE, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.int64), meta,
            caches.ring, caches.compressed, torch.zeros(HEAD_SIZE), compress_ratio=2, block_size=2, eps=1e-6,
            rotary_dim=64, theta=10000.0, section=(12, 10, 10), cache_rope_positions=False,
        )


def test_rejects_two_requests_on_one_ring():
    # Two requests with tokens on ring 0 (a third, without tokens, may name it too: it reads and writes nothing).
    caches = Caches(Storage(r=2, num_spec=0, rope=False), num_blocks=4, num_rings=2, seed=0)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    meta = build_qsa_metadata(i32([0, 2, 4, 4]), i32([2, 2, 0]), i32([[1], [2], [3]]), i32([0, 0, 0]),
                              compress_ratio=2, ring_capacity=2, block_size=2)
    with pytest.raises(ValueError, match=r"two requests of this forward share a ring: ring_blocks \[0, 0\]"):
        qsa_forward_update(
            torch.zeros(4, 1, HEAD_SIZE, dtype=torch.bfloat16), torch.zeros(4, 3, dtype=torch.int64), meta,
            caches.ring, caches.compressed, torch.zeros(HEAD_SIZE), compress_ratio=2, block_size=2, eps=1e-6,
            rotary_dim=64, theta=10000.0, section=(12, 10, 10), cache_rope_positions=False,
        )
