"""A cos/sin table of the rotary pairs indexed by position, made once by torch and read by the QSA ops.

The rotary's cos/sin at position ``p`` for pair ``j`` are torch's fp32 ``cos`` / ``sin`` of the fp32
angle ``fp32(p) * inv_freq[j]`` (``rope_inv_freq`` below, the reference's frequencies: ``kpool_pd.kernels.qsa_rope.ref``). ``RopeCache.build`` evaluates exactly those
for every position below ``num_positions`` with the same torch ops, so a row of the table holds the
values that the reference computes for that position on the same device; an MRoPE position
``(t, h, w)`` takes, for each pair, the row of that pair's axis. This is the layout of vLLM's rotary
``cos_sin_cache``: row ``p`` holds the cos of the ``rotary_dim / 2`` pairs, then their sin.

Why a table: an angle above about 1e5 radians (positions past about 1e5 for the fastest pairs) takes
the slow argument reduction of the CUDA math library's cosf/sinf; a table read costs one load. On the
H200 that saved about 4% of a prefill update and nothing measurable of a decode step (positions up to
2**20; bench/results/2026-12-01-h200-qsa-kernels.txt). Positions outside ``[0, num_positions)`` are
still computed (the same values, without the table). The table costs ``num_positions * rotary_dim * 4`` bytes on its
device (256 MiB for 2**20 positions of the default 64 rotary dims); one table serves every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    # returns: [rotary_dim // 2] fp32, theta ** (-2j / rotary_dim) computed in float64, rounded once
    j = torch.arange(rotary_dim // 2, dtype=torch.float64, device=device)
    return (float(theta) ** (-2.0 * j / rotary_dim)).to(torch.float32)


@dataclass(frozen=True, kw_only=True, eq=False)
class RopeCache:
    """cos/sin of every rotary pair at the positions ``[0, num_positions)`` for one ``(rotary_dim, theta)``.

    Made by ``build`` (not by hand: the ops trust its values and check only its parameters, shape, dtype
    and device). Read-only; an op given one reads the rows of the positions it rotates.
    """

    rotary_dim: int
    theta: float
    table: torch.Tensor  # [num_positions, rotary_dim] fp32, contiguous: cos of the pairs, then their sin

    def __post_init__(self) -> None:
        if not isinstance(self.rotary_dim, int) or self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even integer, got {self.rotary_dim!r}")
        t = self.table
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2 \
                or t.shape[1] != self.rotary_dim or t.shape[0] < 1 or not t.is_contiguous():
            shown = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"table must be contiguous fp32 [num_positions >= 1, {self.rotary_dim}], got {shown}")

    @property
    def num_positions(self) -> int:
        return self.table.shape[0]

    @property
    def device(self) -> torch.device:
        return self.table.device

    @classmethod
    def build(cls, num_positions: int, *, rotary_dim: int, theta: float,
              device: torch.device | str = "cpu") -> RopeCache:
        """The table of positions ``[0, num_positions)``, computed on ``device`` (the device of the ops that
        read it: torch's cos/sin are those of the device).
        # -> table: [num_positions, rotary_dim] fp32"""
        if not isinstance(num_positions, int) or isinstance(num_positions, bool) or num_positions < 1:
            raise ValueError(f"num_positions must be a positive integer, got {num_positions!r}")
        if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even integer, got {rotary_dim!r}")
        inv_freq = rope_inv_freq(rotary_dim, theta, device)
        position = torch.arange(num_positions, dtype=torch.int64, device=device)
        angle = position.to(torch.float32)[:, None] * inv_freq  # [P, rotary_dim / 2], the reference's product
        table = torch.cat([torch.cos(angle), torch.sin(angle)], dim=1)
        return cls(rotary_dim=rotary_dim, theta=float(theta), table=table)

    def __repr__(self) -> str:
        return (f"RopeCache(rotary_dim={self.rotary_dim}, theta={self.theta}, num_positions={self.num_positions}, "
                f"device={self.device})")


def check_rope_cache(cache: object, *, rotary_dim: int, theta: float, device: torch.device) -> None:
    """``cache`` is None or a RopeCache of this rotary (``rotary_dim``, ``theta``) on ``device`` (ValueError
    naming the values otherwise; reads no tensor values)."""
    if cache is None:
        return
    if not isinstance(cache, RopeCache):
        raise TypeError(f"rope_cache must be a RopeCache or None, got {type(cache).__name__}")
    if cache.rotary_dim != rotary_dim or cache.theta != float(theta):
        raise ValueError(f"rope_cache holds rotary_dim {cache.rotary_dim}, theta {cache.theta}; this rotary has "
                         f"rotary_dim {rotary_dim}, theta {float(theta)}")
    if cache.device != device:
        raise ValueError(f"rope_cache is on {cache.device}, the op's tensors on {device}")
