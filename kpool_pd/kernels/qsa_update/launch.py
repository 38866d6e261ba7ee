"""How the forward update launches: its grid (two launches over work items, or one launch over requests), groups
and warps a program, programmatic dependent launch, and how the rotary partner is found. Every launch writes the
same bytes.

The prefill default (``default_update_launch``) was measured on the H200. A grid of one program per token and head,
which shortens each program's chain of dependent loads by two rounds, was tried beside it for decode steps
and saved nothing (bench/results/2026-12-03-h200-qsa-update-variants.txt), so it is not kept.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton

from kpool_pd.kernels.qsa_metadata.ref import QsaMetadata


class UpdateGrid(enum.Enum):
    """``WORK_ITEMS``: two launches, the compression over ``k_work`` (``block`` items a program), then the ring write
    (every ring read before every ring write: any forward). ``REQUESTS``: one launch, one program per request, which
    compresses its groups (``block`` a tile) and then writes its own ring rows (made for decode steps; any forward is
    right, but one program then takes a long chunk's groups alone)."""

    WORK_ITEMS = "work items"
    REQUESTS = "per request"


@dataclass(frozen=True, kw_only=True)
class UpdateLaunch:
    """Launch options of the forward update's compression kernel (the ring write's are its own).

    ``grid``: see ``UpdateGrid``; ``block``: k_work items a program (WORK_ITEMS) or a request's groups a tile
    (REQUESTS); ``num_warps``: warps a program; ``pdl``: programmatic dependent launch of the kernels where the GPU
    has it; ``paired``: the rotary partner by swapping the normed tile's halves where ``rope_pairs_fit`` (else it
    is pooled anew)."""

    grid: UpdateGrid = UpdateGrid.WORK_ITEMS
    block: int = 1
    num_warps: int = 1
    pdl: bool = True
    paired: bool = True

    def __post_init__(self):
        if not isinstance(self.grid, UpdateGrid):
            raise ValueError(f"grid must be an UpdateGrid, got {self.grid!r}")
        if self.block < 1 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two >= 1, got {self.block}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")

    @property
    def label(self) -> str:
        """A short readable name, e.g. ``1/1w`` (work items: items and warps a program) or ``per request 1/1w``
        (a request's groups a tile, warps)."""
        prefix = "per request " if self.grid is UpdateGrid.REQUESTS else ""
        extras = ("" if self.pdl else " no-PDL") + ("" if self.paired else " recomputed")
        return f"{prefix}{self.block}/{self.num_warps}w{extras}"


WAVE_PROGRAMS_PER_SM = 8


def decode_query_len(metadata: QsaMetadata) -> int | None:
    """The most tokens a request of this forward has, when it is a decode step (every request at most the ring's C
    tokens; known from the host counts ``metadata.split`` where the builder set them, else assumed from at most
    requests x C tokens, the bound the ring write also goes by); None for a prefill forward."""
    capacity = metadata.ring_capacity
    if metadata.split is not None:
        longest = metadata.split.max_query_len
        return longest if longest <= capacity else None
    return capacity if metadata.num_tokens <= metadata.num_requests * capacity else None


def default_update_launch(*, metadata: QsaMetadata, device: torch.device) -> UpdateLaunch:
    """The launch a call takes without one given.

    A decode step (``decode_query_len``): one launch, a program per request, one warp, a tile of the groups its
    longest request completes (``ceil(q / r)``: one for 4 tokens and r = 4); chosen for saving the second launch,
    its time beside the two launches' on the H200 is the per-request rows of
    ``python3 -m kpool_pd.bench.qsa_update_variants --device cuda``.

    A prefill forward, two launches. CPU (the interpreter): four groups a program, four warps. CUDA: one warp a
    program, one group a program while the grid fits one wave, two beyond. Measured on the H200
    (bench/results/2026-12-01-h200-qsa-kernels.txt): a prefill of 64 x 4096 tokens 83 us with (2, 1), 97 with
    (1, 1), 98 with (4, 2), 99 with (4, 1), 112 with (2, 2), 153 with (1, 2); a decode step of 256 x 4 tokens 11.6 us
    a call in a 32-call graph with (1, 1) and 11.4 with (1, 2); one flushed call 9.70 / 9.89 / 9.79 us with (1, 1) in
    three runs in a row (``python3 -m kpool_pd.bench.qsa_update_variants --device cuda``, 2026-12-03)."""
    longest = decode_query_len(metadata)
    if longest is not None:
        groups = -(-max(longest, 1) // metadata.compress_ratio)
        return UpdateLaunch(grid=UpdateGrid.REQUESTS, block=triton.next_power_of_2(groups), num_warps=1)
    if device.type != "cuda":
        return UpdateLaunch(block=4, num_warps=4)
    max_work = metadata.k_work.shape[0]
    one_wave = max_work <= WAVE_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return UpdateLaunch(block=1 if one_wave else 2, num_warps=1)
