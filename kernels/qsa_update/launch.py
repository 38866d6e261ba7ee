"""How the forward update's compression launches: its grid, programs' sizes and launch options.

Two grids compute the same bytes:

- ``WORK``: one program per ``block`` items of ``k_work``. Each program's loads form a chain of dependent
  rounds: the item, then its request's offsets, length and ring, then the group's first position, then the
  cos/sin table and the keys. Fit for a prefill (many groups a request, a fraction of the tokens).
- ``TOKENS``: one program per ``block`` tokens and per head; a token whose ``compressed_slot_mapping`` is a
  row completes a group and compresses it. Everything it needs from the metadata is indexed by the token
  (its request, position, ring slot, slot) and is read in the first round together with the group's keys and
  first position, which lie at the r tokens ending at it whenever the group is inside the chunk; a straddling
  group's older keys and packed position come from the ring in the second round, its ring found from the
  token's ring slot (every token of a decode step has one; else from ``ring_blocks``). About two dependent
  rounds fewer than ``WORK`` for a decode step; a grid of every token, so for decode steps only.

The default (``default_update_launch``) is ``WORK``: measured side by side on the H200, ``TOKENS`` saves no
time (the chain it shortens is not what a flushed call waits on). ``TOKENS`` stays a launch a caller may pick.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class CompressGrid(enum.Enum):
    WORK = "work"  # programs over k_work items
    TOKENS = "tokens"  # programs over (tokens, heads): the token that completes a group compresses it


@dataclass(frozen=True, kw_only=True)
class UpdateLaunch:
    """Launch options of the forward update's compression kernel (the ring write's are its own).

    ``block``: k_work items (``WORK``) or tokens (``TOKENS``) a program; ``num_warps``: warps a program;
    ``pdl``: programmatic dependent launch of both kernels where the GPU has it; ``paired``: the rotary partner
    by swapping the normed tile's halves where ``rope_pairs_fit`` (``TOKENS`` needs it: without it the launch
    falls back to ``WORK``)."""

    grid: CompressGrid = CompressGrid.WORK
    block: int = 1
    num_warps: int = 1
    pdl: bool = True
    paired: bool = True

    def __post_init__(self):
        if not isinstance(self.grid, CompressGrid):
            raise TypeError(f"grid must be a CompressGrid, got {self.grid!r}")
        if self.block < 1 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two >= 1, got {self.block}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")

    @property
    def label(self) -> str:
        """A short readable name, e.g. ``tokens/1/1w``."""
        extras = ("" if self.pdl else " no-PDL") + ("" if self.paired else " recomputed")
        return f"{self.grid.value}/{self.block}/{self.num_warps}w{extras}"


WAVE_PROGRAMS_PER_SM = 8


def default_update_launch(*, max_work: int, device: torch.device) -> UpdateLaunch:
    """The launch a call takes without one given: ``WORK``.

    CPU (the interpreter): four items a program, four warps. CUDA: one warp a program, one group a program while
    the grid fits one wave, two beyond. ``TOKENS`` is no faster on the H200: a decode step of 256 x 4 tokens,
    one call after an L2 flush, three runs in a row, 10.11 / 9.79 / 10.03 us against ``WORK``'s 9.70 / 9.89 /
    9.79 (``python3 -m bench.qsa_update_variants --device cuda``, bench/results/2026-12-03-h200-qsa-update-variants.txt).
    Measured on the H200 (bench/results/2026-12-01-h200-qsa-kernels.txt) for ``WORK``: a prefill of 64 x 4096
    tokens 83 us with (2, 1), 97 with (1, 1), 98 with (4, 2), 99 with (4, 1), 112 with (2, 2), 153 with (1, 2); a
    decode step of 256 x 4 tokens 11.6 us a call in a 32-call graph with (1, 1) and 11.4 with (1, 2)."""
    if device.type != "cuda":
        return UpdateLaunch(grid=CompressGrid.WORK, block=4, num_warps=4)
    one_wave = max_work <= WAVE_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return UpdateLaunch(grid=CompressGrid.WORK, block=1 if one_wave else 2, num_warps=1)
