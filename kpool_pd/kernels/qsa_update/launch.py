"""How the forward update's compression launches: groups and warps a program, programmatic dependent launch,
and how the rotary partner is found. Every launch writes the same bytes.

The default (``default_update_launch``) was measured on the H200. A grid of one program per token and head,
which shortens each program's chain of dependent loads by two rounds, was tried beside it for decode steps
and saved nothing (bench/results/2026-12-03-h200-qsa-update-variants.txt), so it is not kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class UpdateLaunch:
    """Launch options of the forward update's compression kernel (the ring write's are its own).

    ``block``: k_work items (groups) a program; ``num_warps``: warps a program; ``pdl``: programmatic dependent
    launch of both kernels where the GPU has it; ``paired``: the rotary partner by swapping the normed tile's
    halves where ``rope_pairs_fit`` (else it is pooled anew)."""

    block: int = 1
    num_warps: int = 1
    pdl: bool = True
    paired: bool = True

    def __post_init__(self):
        if self.block < 1 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two >= 1, got {self.block}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")

    @property
    def label(self) -> str:
        """A short readable name, e.g. ``1/1w``: groups and warps a program."""
        extras = ("" if self.pdl else " no-PDL") + ("" if self.paired else " recomputed")
        return f"{self.block}/{self.num_warps}w{extras}"


WAVE_PROGRAMS_PER_SM = 8


def default_update_launch(*, max_work: int, device: torch.device) -> UpdateLaunch:
    """The launch a call takes without one given. CPU (the interpreter): four groups a program, four warps. CUDA:
    one warp a program, one group a program while the grid fits one wave, two beyond. Measured on the H200
    (bench/results/2026-12-01-h200-qsa-kernels.txt): a prefill of 64 x 4096 tokens 83 us with (2, 1), 97 with
    (1, 1), 98 with (4, 2), 99 with (4, 1), 112 with (2, 2), 153 with (1, 2); a decode step of 256 x 4 tokens 11.6 us
    a call in a 32-call graph with (1, 1) and 11.4 with (1, 2); one flushed call 9.70 / 9.89 / 9.79 us with (1, 1) in
    three runs in a row (``python3 -m kpool_pd.bench.qsa_update_variants --device cuda``, 2026-12-03)."""
    if device.type != "cuda":
        return UpdateLaunch(block=4, num_warps=4)
    one_wave = max_work <= WAVE_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return UpdateLaunch(block=1 if one_wave else 2, num_warps=1)
