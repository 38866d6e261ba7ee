"""The Walsh-Hadamard rotation of the kpool indexer, in a fixed butterfly order."""

from __future__ import annotations

import math

import torch

HADAMARD_DIM = 128
INV_SQRT_DIM = 1.0 / math.sqrt(HADAMARD_DIM)  # rounded to fp32 where it is applied
BUTTERFLY_HALVES = (64, 32, 16, 8, 4, 2, 1)  # stage order; fixed so fp32 rounding is reproducible


def hadamard_matrix(n: int = HADAMARD_DIM) -> torch.Tensor:
    """Sylvester-ordered Hadamard matrix H_n (entries +-1): H_2n = [[H, H], [H, -H]].

    # -> [n, n] fp32
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def fwht(x: torch.Tensor) -> torch.Tensor:
    """H_128 x by butterflies in fp32, halves 64, 32, ..., 1 (equal to ``x @ hadamard_matrix().T``
    in exact arithmetic; this order fixes the fp32 rounding).

    # x: [P, 128] fp32 -> [P, 128] fp32
    """
    if x.shape[-1] != HADAMARD_DIM:
        raise ValueError(f"fwht needs a last dimension of {HADAMARD_DIM}, got shape {tuple(x.shape)}")
    rows = x.shape[0]
    for half in BUTTERFLY_HALVES:
        pairs = x.reshape(rows, HADAMARD_DIM // (2 * half), 2, half)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        x = torch.stack([a + b, a - b], dim=2).reshape(rows, HADAMARD_DIM)
    return x
