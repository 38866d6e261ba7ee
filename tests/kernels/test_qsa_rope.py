"""Interleaved MRoPE tables and NeoX rotary (kernels.qsa_rope)."""

import math

import pytest
import torch

from kpool_pd.kernels.qsa_rope import (RopeCache, apply_neox_rotary, mrope_axis_of_pair, mrope_cos_sin, rope_inv_freq,
                              text_positions)

TIME, HEIGHT, WIDTH = 0, 1, 2


@pytest.mark.parametrize(
    "pair, axis",
    [(0, TIME), (1, HEIGHT), (2, WIDTH), (3, TIME), (4, HEIGHT), (27, TIME), (28, HEIGHT), (29, WIDTH),
     (30, TIME), (31, TIME)],
    ids=lambda v: str(v),
)
def test_default_sections_map_pairs_by_hand(pair, axis):
    # (12, 10, 10) over 32 pairs: height/width interleave below 3*10 = 30, time takes the rest
    # (pair 31 has 31 % 3 == 1 but lies past the height section).
    assert mrope_axis_of_pair(64, (12, 10, 10))[pair] == axis


def test_default_sections_sizes():
    axes = mrope_axis_of_pair(64, (12, 10, 10))
    assert [axes.count(a) for a in (TIME, HEIGHT, WIDTH)] == [12, 10, 10]


def test_small_sections_by_hand():
    assert mrope_axis_of_pair(16, (4, 2, 2)) == [0, 1, 2, 0, 1, 2, 0, 0]


@pytest.mark.parametrize("pair", [0, 1, 2, 3, 28, 29, 30, 31], ids=lambda j: f"pair{j}")
def test_cos_sin_use_the_pair_axis_and_frequency(pair):
    t, h, w = 3, 50, 700
    positions = torch.tensor([[t, h, w]], dtype=torch.int64)
    cos, sin = mrope_cos_sin(positions, rotary_dim=64, theta=10000.0, section=(12, 10, 10))
    axis_pos = {0: t, 1: h, 2: w}[mrope_axis_of_pair()[pair]]
    angle = axis_pos * 10000.0 ** (-2 * pair / 64)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (1, 32)
    # fp32 angle: |error| <= a few ulp of the angle
    assert cos[0, pair].item() == pytest.approx(math.cos(angle), abs=1e-4)
    assert sin[0, pair].item() == pytest.approx(math.sin(angle), abs=1e-4)


def test_angle_is_one_fp32_product():
    positions = torch.tensor([[123, 4567, 89]], dtype=torch.int64)
    cos, sin = mrope_cos_sin(positions)
    inv_freq = rope_inv_freq(64, 10000.0)
    axes = mrope_axis_of_pair()
    angle = torch.tensor([float(positions[0, a]) for a in axes], dtype=torch.float32) * inv_freq
    assert torch.equal(cos[0], torch.cos(angle)) and torch.equal(sin[0], torch.sin(angle))


def test_inv_freq_rounded_once_from_float64():
    inv_freq = rope_inv_freq(64, 10000.0)
    expected = torch.tensor([10000.0 ** (-2 * j / 64) for j in range(32)], dtype=torch.float64).float()
    assert torch.equal(inv_freq, expected)


@pytest.mark.parametrize("n", [1, 5], ids=lambda n: f"N{n}")
def test_text_positions_give_plain_1d_rope(n):
    pos = torch.arange(n, dtype=torch.int64) * 37 + 2
    positions = text_positions(pos)
    assert positions.shape == (n, 3) and torch.equal(positions, pos[:, None].expand(n, 3))
    cos, sin = mrope_cos_sin(positions)
    angle = pos.float()[:, None] * rope_inv_freq(64, 10000.0)
    assert torch.equal(cos, torch.cos(angle)) and torch.equal(sin, torch.sin(angle))


def test_neox_rotary_by_hand():
    # D = 8, rotary_dim = 4: pairs (x0, x2) and (x1, x3); x4..x7 pass through.
    x = torch.arange(1, 9, dtype=torch.float32)[None, None, :]  # [N=1, H=1, D=8]
    cos = torch.tensor([[0.5, 0.25]])
    sin = torch.tensor([[0.75, -1.0]])
    out = apply_neox_rotary(x, cos, sin, rotary_dim=4)
    expected = [1 * 0.5 - 3 * 0.75, 2 * 0.25 - 4 * -1.0, 3 * 0.5 + 1 * 0.75, 4 * 0.25 + 2 * -1.0, 5, 6, 7, 8]
    assert out[0, 0].tolist() == expected


def test_neox_rotary_preserves_pair_norms_and_passes_through():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 128)
    cos, sin = mrope_cos_sin(torch.randint(0, 10_000, (3, 3)))
    out = apply_neox_rotary(x, cos, sin, rotary_dim=64)
    assert torch.equal(out[..., 64:], x[..., 64:])
    pair_norm = lambda t: t[..., :32] ** 2 + t[..., 32:64] ** 2  # noqa: E731
    assert torch.allclose(pair_norm(out), pair_norm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "positions, kwargs, match",
    [
        (torch.zeros(2, 3, dtype=torch.int32), {}, "int64"),
        (torch.zeros(2, 2, dtype=torch.int64), {}, r"\[N, 3\]"),
        (torch.zeros(2, 3, dtype=torch.int64), {"rotary_dim": 63, "section": (12, 10, 10)}, "even"),
        (torch.zeros(2, 3, dtype=torch.int64), {"section": (12, 10, 9)}, "sum"),
        (torch.zeros(2, 3, dtype=torch.int64), {"section": (2, 20, 10)}, "interleav"),
    ],
    ids=["int32-positions", "two-axes", "odd-rotary-dim", "section-sum", "section-not-interleavable"],
)
def test_rejects_bad_inputs(positions, kwargs, match):
    with pytest.raises(ValueError, match=match):
        mrope_cos_sin(positions, **kwargs)


# --- the cos/sin table by position ------------------------------------------------------------------------


def test_rope_cache_rows_are_the_computed_values():
    # Row p holds torch's cos/sin of fp32(p) * inv_freq, as mrope_cos_sin computes them for text positions.
    cache = RopeCache.build(3000, rotary_dim=64, theta=10000.0)
    cos, sin = mrope_cos_sin(text_positions(torch.arange(3000)))
    assert cache.table.shape == (3000, 64) and cache.table.dtype == torch.float32
    assert torch.equal(cache.table[:, :32], cos) and torch.equal(cache.table[:, 32:], sin)
    assert torch.equal(cache.table[0], torch.tensor([1.0] * 32 + [0.0] * 32))
    assert cache.table[1, 0].item() == pytest.approx(math.cos(1.0), abs=1e-7)
    assert cache.table[1, 32].item() == pytest.approx(math.sin(1.0), abs=1e-7)


def test_mrope_reads_each_pair_axis_row_and_computes_past_the_table():
    cache = RopeCache.build(1000, rotary_dim=64, theta=10000.0)
    gen = torch.Generator().manual_seed(2)
    positions = torch.randint(0, 1000, (50, 3), generator=gen)
    positions[::3, 1] += 5000  # some heights past the table
    positions[1::3, 0] = -7  # a negative time position (computed)
    positions[-1] = torch.tensor([999, 1000, 0])  # the last held row and the first outside it
    cos, sin = mrope_cos_sin(positions, cache=cache)
    plain_cos, plain_sin = mrope_cos_sin(positions)
    assert torch.equal(cos, plain_cos) and torch.equal(sin, plain_sin)  # the same values, held or not
    axes = torch.tensor(mrope_axis_of_pair())
    pair_pos = positions[:, axes]
    held = (pair_pos >= 0) & (pair_pos < 1000)
    rows = cache.table[pair_pos.clamp(0, 999), torch.arange(32)]
    assert torch.equal(cos[held], rows[held])


def test_rope_cache_checks():
    cache = RopeCache.build(8, rotary_dim=64, theta=10000.0)
    positions = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"rope_cache holds rotary_dim 64, theta 10000.0; this rotary has rotary_dim 64, theta 500.0"):
        mrope_cos_sin(positions, theta=500.0, cache=cache)
    with pytest.raises(TypeError, match="RopeCache or None"):
        mrope_cos_sin(positions, cache=cache.table)
    with pytest.raises(ValueError, match="positive integer"):
        RopeCache.build(0, rotary_dim=64, theta=10000.0)
    with pytest.raises(ValueError, match=r"contiguous fp32 \[num_positions >= 1, 64\]"):
        RopeCache(rotary_dim=64, theta=10000.0, table=torch.zeros(4, 32))
    with pytest.raises(ValueError, match="even"):
        RopeCache.build(4, rotary_dim=5, theta=10000.0)
