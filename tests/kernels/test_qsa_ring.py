"""The QSA key state ring: raw keys and packed positions (kernels.qsa_ring)."""

import pytest
import torch

from kpool_pd.kernels.qsa_ring import position_offset, read_qsa_ring_positions, write_qsa_ring
from kpool_pd.kvcache import BlockLayout, CacheConfig, CacheFamily, CachePool, qsa_ring_capacity


def poisoned_pool(*, heads=2, head_size=128, num_spec=3, cache_rope_positions=True, seed=0):
    config = CacheConfig(
        family=CacheFamily.QSA, layer_names=("layer.0", "layer.1"), block_size=24, compress_ratio=4,
        num_spec=num_spec, qsa_num_heads=heads, qsa_head_size=head_size, cache_rope_positions=cache_rope_positions,
    )
    pool = CachePool(BlockLayout(config), num_blocks=2, num_rings=3)
    gen = torch.Generator().manual_seed(seed)
    pool.rings.copy_(torch.randint(0, 256, pool.rings.shape, generator=gen, dtype=torch.uint8))  # poison
    return pool


def multimodal_positions(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(-(2 ** 62), 2 ** 62, (n, 3), generator=gen)
    positions[0] = torch.tensor([2 ** 32 + 1, 2 ** 40 + 7, 2 ** 63 - 1])  # > 2**32, and int64's largest
    positions[-1] = torch.tensor([5, 17, -3])  # small, different per axis
    return positions


@pytest.mark.parametrize("num_tokens", [1, 7], ids=lambda n: f"T{n}")
def test_round_trip_keys_and_packed_positions(num_tokens):
    pool = poisoned_pool()
    ring = pool.qsa_ring("layer.1")
    num_rings, cap, heads, width = ring.shape
    off = position_offset(128)
    assert (cap, width, off) == (qsa_ring_capacity(4, 3), 140, 128)
    before = pool.rings.clone()
    ring_before = ring.view(torch.int16).clone()
    layer0_before = pool.qsa_ring("layer.0").view(torch.int16).clone()

    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(num_tokens, heads, 128, generator=gen).to(torch.bfloat16)
    positions = multimodal_positions(num_tokens)
    # Ring 2, positions 5 .. 5 + T - 1 wrap around C = 8; the middle token is skipped.
    token_pos = torch.arange(5, 5 + num_tokens)
    slots = 2 * cap + token_pos % cap
    skipped = num_tokens // 2 if num_tokens > 1 else None
    if skipped is not None:
        slots[skipped] = -1
    write_qsa_ring(ring, keys, positions, slots)

    for t in range(num_tokens):
        row = ring[2, int(token_pos[t]) % cap]
        if t == skipped:
            assert torch.equal(row.view(torch.int16), ring_before[2, int(token_pos[t]) % cap])
            continue
        assert torch.equal(row[:, :128].view(torch.int16), keys[t].view(torch.int16))
        for h in range(heads):  # the literal contract: the 12 slots reinterpret as the 3 positions
            assert row[h, off:off + 12].view(torch.int64).tolist() == positions[t].tolist()
    written = [t for t in range(num_tokens) if t != skipped]
    got = read_qsa_ring_positions(ring, 2, token_pos[written] % cap, head_size=128)
    assert torch.equal(got, positions[written])
    # Rows not written, the other rings and the other layer keep their bytes.
    assert torch.equal(pool.qsa_ring("layer.0").view(torch.int16), layer0_before)
    touched = {int(p) % cap for i, p in enumerate(token_pos) if i != skipped}
    for slot in set(range(cap)) - touched:
        assert torch.equal(ring[2, slot].view(torch.int16), ring_before[2, slot])
    assert torch.equal(pool.rings[:2], before[:2])


def test_padding_between_key_and_positions_is_zeroed():
    # D = 6: off = 8, so slots 6 and 7 are padding; W = 20.
    ring = torch.full((1, 4, 1, 20), float("nan"), dtype=torch.bfloat16)
    keys = torch.arange(12, dtype=torch.float32).view(2, 1, 6).to(torch.bfloat16)
    positions = torch.tensor([[1, 2, 3], [2 ** 33, -(2 ** 35), 9]])
    write_qsa_ring(ring, keys, positions, torch.tensor([3, 0]))
    assert ring[0, 3, 0, :6].tolist() == list(range(6))
    assert ring[0, 3, 0, 6:8].view(torch.int16).tolist() == [0, 0]
    assert torch.equal(read_qsa_ring_positions(ring, 0, torch.tensor([0, 3]), head_size=6), positions.flip(0))
    assert torch.isnan(ring[0, 1:3].float()).all()


def test_without_positions_the_rest_of_the_row_is_zero():
    pool = poisoned_pool(cache_rope_positions=False)
    ring = pool.qsa_ring(0)
    assert ring.shape[-1] == 128
    keys = torch.randn(2, 2, 128).to(torch.bfloat16)
    write_qsa_ring(ring, keys, None, torch.tensor([0, 9]))
    assert torch.equal(ring[0, 0], keys[0]) and torch.equal(ring[1, 1], keys[1])
    # A ring with room for positions, written without them: the position slots become zeros.
    wide = torch.full((1, 2, 2, 140), 7.0, dtype=torch.bfloat16)
    write_qsa_ring(wide, keys, None, torch.tensor([1, -1]))
    assert torch.equal(wide[0, 1, :, :128], keys[0]) and not wide[0, 1, :, 128:].any()
    assert (wide[0, 0] == 7.0).all()


def test_nan_keys_keep_their_bits():
    ring = torch.zeros(1, 2, 1, 140, dtype=torch.bfloat16)
    bits = torch.randint(-(2 ** 15), 2 ** 15, (1, 1, 128), dtype=torch.int16)
    bits[0, 0, :4] = torch.tensor([0x7FC1, -1, 0x7F81, -32767], dtype=torch.int16)  # NaN payloads
    write_qsa_ring(ring, bits.view(torch.bfloat16), torch.zeros(1, 3, dtype=torch.int64), torch.tensor([1]))
    assert torch.equal(ring[0, 1, :, :128].view(torch.int16), bits[0])


def bad_write(change):
    args = {
        "ring": torch.zeros(2, 4, 2, 140, dtype=torch.bfloat16),
        "keys": torch.zeros(3, 2, 128, dtype=torch.bfloat16),
        "positions": torch.zeros(3, 3, dtype=torch.int64),
        "ring_slots": torch.tensor([0, 5, -1]),
    } | change
    write_qsa_ring(args["ring"], args["keys"], args["positions"], args["ring_slots"])


@pytest.mark.parametrize(
    "change, match",
    [
        ({"ring": torch.zeros(2, 4, 2, 120, dtype=torch.bfloat16), "positions": None}, "too narrow"),
        ({"ring": torch.zeros(2, 4, 2, 128, dtype=torch.bfloat16)}, r"off \+ 12 = 140"),
        ({"ring": torch.zeros(2, 4, 2, 144, dtype=torch.bfloat16)}, "144 wide"),
        ({"ring": torch.zeros(2, 4, 2, 140, dtype=torch.float16)}, "ring must be bf16"),
        ({"keys": torch.zeros(3, 1, 128, dtype=torch.bfloat16)}, "H=2"),
        ({"keys": torch.zeros(3, 2, 128)}, "keys must be bf16"),
        ({"positions": torch.zeros(3, 3, dtype=torch.int32)}, "positions must be int64"),
        ({"positions": torch.zeros(2, 3, dtype=torch.int64)}, r"\[3, 3\]"),
        ({"ring_slots": torch.tensor([0, 8, -1])}, r"\[8\] out of range"),
        ({"ring_slots": torch.tensor([0, -2, 1])}, r"\[-2\] out of range"),
        ({"ring_slots": torch.tensor([0, 5, 0])}, "twice"),
        ({"ring_slots": torch.tensor([0.0, 5.0, -1.0])}, "ring_slots must be int32 or int64"),
    ],
    ids=["narrower-than-key", "no-room-for-positions", "wider-than-layout", "fp16-ring", "head-count",
         "fp32-keys", "int32-positions", "positions-rows", "slot-past-end", "slot-below-minus-one",
         "duplicate-slot", "float-slots"],
)
def test_write_rejects_bad_inputs(change, match):
    with pytest.raises(ValueError, match=match):
        bad_write(change)


@pytest.mark.parametrize(
    "ring_id, slots, head_size, match",
    [(2, [0], None, "ring_id 2"), (0, [4], None, r"\[4\] out of range"), (0, [0], 100, "head size 100")],
    ids=["ring-id", "slot-past-capacity", "wrong-head-size"],
)
def test_read_rejects_bad_inputs(ring_id, slots, head_size, match):
    ring = torch.zeros(2, 4, 1, 140, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        read_qsa_ring_positions(ring, ring_id, torch.tensor(slots), head_size=head_size)
