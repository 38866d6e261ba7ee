"""The serving geometry the models ask for, enforced where a daemon or ``kpool-pd up`` starts (the
library and its unit tests keep smaller blocks and pages for their cases):

- the attention block is a multiple of 128 tokens (``BLOCK_SIZE_QUANTUM``);
- a kernel page of the kpool family holds exactly 32 or 64 states (``KERNEL_PAGE_STATES``): DeepGEMM's
  paged-MQA indexer kernel takes pages of those sizes and no other. A block of S states is one page when
  S is 32 or 64, or S / P pages of P states (``kernel_page_states``) when S is a multiple of P; any other
  S is refused: kpool 16 in a 256-token block (16 states), kpool 8 in a 128-token block (16) and kpool 8
  in a 384-token block (48) have no kernel to read them;
- on a GPU of compute capability 12.x (SM120) the kernel takes only pages of 64 states.

Each check raises ``GeometryError``: a ``ValueError`` naming the rule, with the settings keys it
concerns (``options``) so that the caller can say where their values came from.
"""

from __future__ import annotations

import torch

from kpool_pd.kvcache import KERNEL_PAGE_STATES, CacheConfig, CacheFamily
from kpool_pd.model.config import BLOCK_SIZE_QUANTUM

MIN_SERVING_PAGE_STATES = min(KERNEL_PAGE_STATES)  # 32
SM120_MAJOR = 12  # compute capability 12.x: the paged-MQA kernel takes pages of 64 states only
SM120_PAGE_STATES = max(KERNEL_PAGE_STATES)  # 64


class GeometryError(ValueError):
    """A geometry the daemons refuse; ``options`` are the settings keys whose values make it."""

    def __init__(self, message: str, *, options: tuple[str, ...]) -> None:
        super().__init__(message)
        self.options = options


def check_serving_geometry(cache: CacheConfig) -> None:
    """The block is a multiple of 128 tokens and (kpool family) its states fill kernel pages of exactly 32 or 64
    states; ``GeometryError`` naming the rule otherwise."""
    if cache.block_size % BLOCK_SIZE_QUANTUM:
        raise GeometryError(f"a block of {cache.block_size} tokens is refused: the attention block is a multiple of "
                            f"{BLOCK_SIZE_QUANTUM} tokens", options=("block_size",))
    if cache.family is not CacheFamily.KPOOL:
        return
    indexer = cache.kpool_indexer
    page, states = indexer.states_per_page, indexer.states_per_block
    if page not in KERNEL_PAGE_STATES:
        sizes = " or ".join(map(str, KERNEL_PAGE_STATES))
        raise GeometryError(
            f"kpool {cache.kpool} in {cache.block_size}-token blocks makes kernel pages of {page} states: the paged-MQA "
            f"indexer kernel takes pages of {sizes} states and no other, so a block's states (here "
            f"{cache.block_size} / {cache.kpool} = {states}) must be {sizes}, or a multiple of the "
            f"{indexer.kernel_page_states}-state page it is split into (for kpool {cache.kpool}: a block of "
            f"{MIN_SERVING_PAGE_STATES * cache.kpool} tokens or a multiple of "
            f"{indexer.kernel_page_states * cache.kpool}); a kernel page holds at least {MIN_SERVING_PAGE_STATES}",
            options=("kpool", "block_size"))


def check_kernel_page_for_capability(cache: CacheConfig, capability: tuple[int, int]) -> None:
    """On a GPU of compute capability ``capability`` (major, minor), the kernel takes the kpool
    cache's pages: 12.x (SM120) takes pages of 64 states only. ``GeometryError`` otherwise."""
    if cache.family is not CacheFamily.KPOOL or capability[0] != SM120_MAJOR:
        return
    states = cache.kpool_indexer.states_per_page
    if states != SM120_PAGE_STATES:
        raise GeometryError(
            f"kpool {cache.kpool} in {cache.block_size}-token blocks with kernel pages of {states} states is refused on "
            f"a GPU of compute capability {capability[0]}.{capability[1]}: the paged-MQA indexer kernel takes pages of "
            f"{SM120_PAGE_STATES} states only there (--kernel-page-states 64 and a block of at least "
            f"{SM120_PAGE_STATES * cache.kpool} tokens for "
            f"kpool {cache.kpool})", options=("kpool", "block_size", "kernel_page_states"))


def check_kernel_page_on(cache: CacheConfig, device: torch.device) -> None:
    """``check_kernel_page_for_capability`` with ``device``'s compute capability when it is a CUDA
    device; nothing to check on the CPU."""
    if device.type == "cuda":
        check_kernel_page_for_capability(cache, torch.cuda.get_device_capability(device))
