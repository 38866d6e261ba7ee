"""The serving geometry the models ask for, enforced where a daemon or ``kpool-pd up`` starts (the
library and its unit tests keep smaller blocks and pages for their cases):

- the attention block is a multiple of 128 tokens (``BLOCK_SIZE_QUANTUM``);
- a kernel page of the kpool family holds at least 32 states (``MIN_SERVING_PAGE_STATES``): DeepGEMM's
  paged-MQA indexer kernel takes pages of 32 or 64 states, so kpool 16 in a 256-token block (16 states)
  or kpool 8 in a 128-token block has no kernel to read it;
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
    """The block is a multiple of 128 tokens and (kpool family) a kernel page holds at least 32
    states; ``GeometryError`` naming the rule otherwise."""
    if cache.block_size % BLOCK_SIZE_QUANTUM:
        raise GeometryError(f"a block of {cache.block_size} tokens is refused: the attention block is a multiple of "
                            f"{BLOCK_SIZE_QUANTUM} tokens", options=("block_size",))
    if cache.family is not CacheFamily.KPOOL:
        return
    states = cache.kpool_indexer.states_per_page
    if states < MIN_SERVING_PAGE_STATES:
        raise GeometryError(
            f"kpool {cache.kpool} in {cache.block_size}-token blocks makes kernel pages of {states} states: the "
            f"paged-MQA indexer kernel takes pages of {' or '.join(map(str, KERNEL_PAGE_STATES))} states, so a kernel "
            f"page holds at least {MIN_SERVING_PAGE_STATES} (a block of at least {MIN_SERVING_PAGE_STATES * cache.kpool} "
            f"tokens for kpool {cache.kpool})", options=("kpool", "block_size"))


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
