"""Interleaved MRoPE tables and NeoX rotary for the QSA compressed keys (plain torch).

MRoPE gives every token three positions: time, height, width (a text token has all three
equal to its index). The ``rotary_dim / 2`` rotary pairs are shared among the axes by
interleaving: pair ``j`` rotates with

* the height position when ``j % 3 == 1 and j < 3 * section[1]``,
* the width position  when ``j % 3 == 2 and j < 3 * section[2]``,
* the time position otherwise,

so with the default ``section = (12, 10, 10)`` and 32 pairs, height and width take 10 pairs
each (j < 30) and time the remaining 12. A section must sum to ``rotary_dim / 2`` and give
each axis exactly its size under this rule (ValueError otherwise). Pair ``j`` has the frequency
``inv_freq[j] = theta ** (-2j / rotary_dim)``, evaluated in float64 and rounded once to fp32
(``rope_inv_freq``, kept beside the table that ``kpool_pd.kernels.qsa_rope.cache`` builds from it); the
angle ``fp32(position) * inv_freq[j]`` is one fp32 product, and cos/sin are the fp32 ``torch.cos``
/ ``torch.sin`` of that angle. (Positions beyond 2**24 lose precision when converted to fp32; that
is the rotary's definition, not an error.) Given a ``RopeCache`` (the same values computed once by
torch for the positions below its size), the positions it holds take its values, the others are
computed.

The rotary is NeoX style (rotate-half) on the first ``rotary_dim`` dims; the rest pass through.
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.qsa_rope.cache import RopeCache, check_rope_cache, rope_inv_freq

MROPE_AXES = 3  # time, height, width


def _check_rope_params(rotary_dim: int, section: tuple[int, int, int]) -> None:
    if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even integer, got {rotary_dim!r}")
    section = tuple(section)
    if len(section) != MROPE_AXES or any(not isinstance(s, int) or s < 0 for s in section):
        raise ValueError(f"section must be 3 integers >= 0 (time, height, width), got {section!r}")
    if sum(section) != rotary_dim // 2:
        raise ValueError(f"section {section} must sum to rotary_dim/2 = {rotary_dim // 2}, got {sum(section)}")


def mrope_axis_of_pair(rotary_dim: int = 64, section: tuple[int, int, int] = (12, 10, 10)) -> list[int]:
    """For each rotary pair j, the MRoPE axis it rotates with: 0 time, 1 height, 2 width."""
    _check_rope_params(rotary_dim, section)
    axes = []
    for j in range(rotary_dim // 2):
        if j % 3 == 1 and j < 3 * section[1]:
            axes.append(1)
        elif j % 3 == 2 and j < 3 * section[2]:
            axes.append(2)
        else:
            axes.append(0)
    for axis, name in ((1, "height"), (2, "width")):
        if axes.count(axis) != section[axis]:
            raise ValueError(
                f"section {tuple(section)} cannot be interleaved over {rotary_dim // 2} pairs: the {name} axis "
                f"gets {axes.count(axis)} pairs (j % 3 == {axis}, j < {3 * section[axis]}), not {section[axis]}"
            )
    return axes


def text_positions(pos: torch.Tensor) -> torch.Tensor:
    # pos: [N] int64 -> [N, 3] int64 with time = height = width = pos
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or pos.dim() != 1:
        raise ValueError(f"pos must be a 1-D int64 tensor, got {_describe(pos)}")
    return pos[:, None].expand(pos.shape[0], MROPE_AXES).contiguous()


def mrope_cos_sin(
    positions: torch.Tensor,
    *,
    rotary_dim: int = 64,
    theta: float = 10000.0,
    section: tuple[int, int, int] = (12, 10, 10),
    cache: RopeCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # positions: [N, 3] int64 (time, height, width) -> cos, sin: [N, rotary_dim // 2] fp32
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.dim() != 2 \
            or positions.shape[1] != MROPE_AXES:
        raise ValueError(f"positions must be an int64 tensor [N, 3], got {_describe(positions)}")
    axes = torch.tensor(mrope_axis_of_pair(rotary_dim, section), dtype=torch.int64, device=positions.device)
    # pair_pos[n, j] = positions[n, axis(j)]
    pair_pos = positions.index_select(1, axes)
    angle = pair_pos.to(torch.float32) * rope_inv_freq(rotary_dim, theta, positions.device)
    cos, sin = torch.cos(angle), torch.sin(angle)
    if cache is None:
        return cos, sin
    check_rope_cache(cache, rotary_dim=rotary_dim, theta=theta, device=positions.device)
    # A position the table holds takes the table's row (torch's values, computed once on its device).
    half = rotary_dim // 2
    held = (pair_pos >= 0) & (pair_pos < cache.num_positions)
    row = pair_pos.clamp(0, cache.num_positions - 1)
    pair = torch.arange(half, device=positions.device)
    cos = torch.where(held, cache.table[row, pair], cos)
    sin = torch.where(held, cache.table[row, half + pair], sin)
    return cos, sin


def apply_neox_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    # x: [N, ..., D] fp32; cos, sin: [N, rotary_dim // 2] fp32 -> [N, ..., D] fp32 (dims >= rotary_dim copied)
    if x.dtype != torch.float32 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"x, cos, sin must be fp32, got {x.dtype}, {cos.dtype}, {sin.dtype}")
    half = rotary_dim // 2
    if x.shape[-1] < rotary_dim or cos.shape != (x.shape[0], half) or sin.shape != cos.shape:
        raise ValueError(
            f"x {tuple(x.shape)} needs last dim >= rotary_dim {rotary_dim}, and cos {tuple(cos.shape)} / "
            f"sin {tuple(sin.shape)} must be [{x.shape[0]}, {half}]"
        )
    # Broadcast the per-token tables over the middle (head) axes.
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    x1 = x[..., :half]
    x2 = x[..., half:rotary_dim]
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    return torch.cat([out1, out2, x[..., rotary_dim:]], dim=-1)


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)}"
    return type(t).__name__
