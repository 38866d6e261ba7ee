"""Compression of complete QSA groups (kernels.qsa_compress)."""

import math

import numpy as np
import pytest
import torch

from kpool_pd.kernels.qsa_compress import compress_group_keys
from kpool_pd.kernels.qsa_rope import mrope_axis_of_pair

ROPE = {"rotary_dim": 64, "theta": 10000.0, "section": (12, 10, 10)}
HEIGHT_PAIRS = [j for j, a in enumerate(mrope_axis_of_pair()) if a == 1]
WIDTH_PAIRS = [j for j, a in enumerate(mrope_axis_of_pair()) if a == 2]
TIME_PAIRS = [j for j, a in enumerate(mrope_axis_of_pair()) if a == 0]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float8_e4m3fn, id="fp8")]


def compress(keys, positions, weight, *, eps=1e-6, out_dtype=torch.bfloat16):
    return compress_group_keys(keys, positions, weight, eps=eps, out_dtype=out_dtype, **ROPE)


def hand_group():
    """r = 2, H = 1, D = 128: k0 = 1, k1 = 3 everywhere, so pooled = 2 and mean(x^2) = 4.

    With eps = 0 the norm is exactly x / 2 * (1 + w): w = 0.5 on even dims, -0.25 on odd dims
    gives normed = 1.5 (even) and 0.75 (odd), all exact in bf16 and fp8.
    """
    keys = torch.empty(1, 2, 1, 128, dtype=torch.bfloat16)
    keys[:, 0] = 1.0
    keys[:, 1] = 3.0
    weight = torch.tensor([0.5 if d % 2 == 0 else -0.25 for d in range(128)], dtype=torch.float32)
    normed = torch.tensor([1.5 if d % 2 == 0 else 0.75 for d in range(128)])
    return keys, weight, normed


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_hand_example_at_position_zero_is_the_norm(out_dtype):
    keys, weight, normed = hand_group()
    out = compress(keys, torch.zeros(1, 3, dtype=torch.int64), weight, eps=0.0, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (1, 1, 128)
    assert torch.equal(out[0, 0].float(), normed)


@pytest.mark.parametrize(
    "position, rotated_pairs",
    [((0, 5, 0), HEIGHT_PAIRS), ((0, 0, 5), WIDTH_PAIRS), ((5, 0, 0), TIME_PAIRS), ((5, 5, 5), list(range(32)))],
    ids=["height-only", "width-only", "time-only", "text"],
)
def test_hand_example_rotates_only_the_axis_pairs(position, rotated_pairs):
    keys, weight, normed = hand_group()
    out = compress(keys, torch.tensor([position], dtype=torch.int64), weight, eps=0.0)[0, 0].float()
    assert torch.equal(out[64:], normed[64:])  # pass-through dims
    for j in range(32):
        x1, x2 = normed[j].item(), normed[j + 32].item()
        if j not in rotated_pairs:
            assert (out[j].item(), out[j + 32].item()) == (x1, x2), f"pair {j} rotated"
            continue
        # Hand value in float64; the op rotates in fp32 then rounds to bf16, so allow one bf16 ulp.
        angle = 5 * 10000.0 ** (-2 * j / 64)
        want1 = x1 * math.cos(angle) - x2 * math.sin(angle)
        want2 = x2 * math.cos(angle) + x1 * math.sin(angle)
        assert out[j].item() == pytest.approx(want1, abs=2 ** -7 * max(abs(want1), 2 ** -6))
        assert out[j + 32].item() == pytest.approx(want2, abs=2 ** -7 * max(abs(want2), 2 ** -6))


def test_a_few_hand_values_at_position_one():
    # Pair 0 (time, inv_freq 1): angle 1 rad; dims 0 and 32 both hold 1.5.
    keys, weight, _ = hand_group()
    out = compress(keys, torch.tensor([[1, 1, 1]]), weight, eps=0.0)[0, 0].float()
    assert out[0].item() == pytest.approx(1.5 * (math.cos(1) - math.sin(1)), rel=2 ** -7)  # -0.4518
    assert out[32].item() == pytest.approx(1.5 * (math.cos(1) + math.sin(1)), rel=2 ** -7)  # 2.0716
    assert out[100].item() == 1.5 and out[101].item() == 0.75


def bf16_round(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 (as fp32), round to nearest even, by bit arithmetic."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def emulate(keys: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor, eps: float) -> np.ndarray:
    """The recipe element by element in numpy fp32 (an independent implementation)."""
    k = keys.float().numpy()
    groups, ratio, heads, dim = k.shape
    w = weight.numpy()
    axes = mrope_axis_of_pair()
    inv_freq = [np.float32(10000.0 ** (-2 * j / 64)) for j in range(32)]
    out = np.zeros((groups, heads, dim), dtype=np.float32)
    for g in range(groups):
        for h in range(heads):
            pooled = np.zeros(dim, dtype=np.float32)
            for d in range(dim):
                acc = np.float32(k[g, 0, h, d])
                for i in range(1, ratio):
                    acc = np.float32(acc + np.float32(k[g, i, h, d]))
                pooled[d] = np.float32(acc / np.float32(ratio))
            x = bf16_round(pooled)
            sq = np.float32(0)
            for d in range(dim):
                sq = np.float32(sq + np.float32(x[d] * x[d]))
            inv_rms = np.float32(1) / np.sqrt(np.float32(sq / np.float32(dim)) + np.float32(eps))
            normed = bf16_round(np.array([np.float32(x[d] * inv_rms) * np.float32(1 + w[d]) for d in range(dim)]))
            row = normed.copy()
            for j in range(32):
                angle = np.float32(np.float32(positions[g, axes[j]].item()) * inv_freq[j])
                c, s = np.cos(angle), np.sin(angle)
                row[j] = np.float32(normed[j] * c) - np.float32(normed[j + 32] * s)
                row[j + 32] = np.float32(normed[j + 32] * c) + np.float32(normed[j] * s)
            out[g, h] = bf16_round(row)
    return out


def test_matches_an_elementwise_emulation():
    # fp32 internals (the mean's summation order, rsqrt, cos/sin) may differ in their last bit,
    # which can move a value across a bf16 rounding boundary: allow one bf16 ulp, and require
    # nearly all elements to agree exactly (an extra or missing rounding step would not).
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(3, 3, 2, 128, generator=gen).to(torch.bfloat16)  # r = 3: division is inexact
    positions = torch.randint(0, 5000, (3, 3), generator=gen)
    weight = torch.randn(128, generator=gen) * 0.1
    got = compress(keys, positions, weight).float().numpy()
    want = emulate(keys, positions, weight, 1e-6)
    ulp = np.abs(want) * 2.0 ** -7
    assert np.all(np.abs(got - want) <= ulp), np.max(np.abs(got - want) / np.maximum(ulp, 1e-30))
    assert np.mean(got == want) >= 0.99


def test_groups_sum_sequentially():
    # Slots 2**30, 1, -2**30: ((a + b) + c) loses the 1 in fp32 (ulp 128 at 2**30) -> 0;
    # any other order would give 1/3. Dim 100 passes through the rotary at position 0.
    keys = torch.ones(1, 3, 1, 128, dtype=torch.bfloat16)
    keys[0, :, 0, 100] = torch.tensor([2.0 ** 30, 1.0, -(2.0 ** 30)])
    out = compress(keys, torch.zeros(1, 3, dtype=torch.int64), torch.zeros(128))
    assert out[0, 0, 100].item() == 0.0 and out[0, 0, 101].item() != 0.0


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_batch_invariant_and_deterministic(out_dtype):
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(5, 4, 2, 128, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 2 ** 40, (5, 3), generator=gen)
    weight = torch.randn(128, generator=gen)
    together = compress(keys, positions, weight, out_dtype=out_dtype)
    again = compress(keys, positions, weight, out_dtype=out_dtype)
    assert torch.equal(together.view(torch.uint8), again.view(torch.uint8))
    for g in range(5):
        alone = compress(keys[g:g + 1], positions[g:g + 1], weight, out_dtype=out_dtype)
        assert torch.equal(alone.view(torch.uint8), together[g:g + 1].view(torch.uint8))


def test_ratio_one_is_norm_then_rotary():
    keys, weight, normed = hand_group()
    one = keys[:, :1] * 2  # a single key of 2.0 everywhere: same norm as the hand group
    out = compress(one, torch.zeros(1, 3, dtype=torch.int64), weight, eps=0.0)
    assert torch.equal(out[0, 0].float(), normed)


def test_fp8_is_static_scale_and_saturates():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 2, 1, 128, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 100, (2, 3), generator=gen)
    big = torch.full((128,), 2000.0)  # (1 + w) ~ 2000: most values exceed 448
    out = compress(keys, positions, big, out_dtype=torch.float8_e4m3fn).float()
    assert not torch.isnan(out).any()
    assert out.abs().max().item() == 448.0
    # Scale 1.0: the fp8 value is the bf16 value's neighbourhood (within an fp8 step).
    small = torch.zeros(128)
    as_fp8 = compress(keys, positions, small, out_dtype=torch.float8_e4m3fn).float()
    as_bf16 = compress(keys, positions, small, out_dtype=torch.bfloat16).float()
    assert torch.all((as_fp8 - as_bf16).abs() <= as_bf16.abs() * 2 ** -3 + 2 ** -9)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"keys": torch.zeros(1, 2, 1, 128)}, "keys must be bf16"),
        ({"keys": torch.zeros(1, 0, 1, 128, dtype=torch.bfloat16)}, "r >= 1"),
        ({"first_positions": torch.zeros(1, 3, dtype=torch.int32)}, "first_positions"),
        ({"first_positions": torch.zeros(2, 3, dtype=torch.int64)}, r"int64 \[1, 3\]"),
        ({"norm_weight": torch.zeros(64)}, r"fp32 \[128\]"),
        ({"norm_weight": torch.zeros(128, dtype=torch.bfloat16)}, "norm_weight"),
        ({"out_dtype": torch.float16}, "out_dtype"),
        ({"keys": torch.zeros(1, 2, 1, 32, dtype=torch.bfloat16), "norm_weight": torch.zeros(32)}, "rotary_dim 64"),
    ],
    ids=["fp32-keys", "empty-group", "int32-positions", "positions-rows", "weight-size", "weight-dtype",
         "fp16-out", "head-smaller-than-rotary"],
)
def test_rejects_bad_inputs(change, match):
    args = {
        "keys": torch.zeros(1, 2, 1, 128, dtype=torch.bfloat16),
        "first_positions": torch.zeros(1, 3, dtype=torch.int64),
        "norm_weight": torch.zeros(128),
        "out_dtype": torch.bfloat16,
    } | change
    with pytest.raises(ValueError, match=match):
        compress_group_keys(
            args["keys"], args["first_positions"], args["norm_weight"], eps=1e-6, out_dtype=args["out_dtype"], **ROPE
        )

