"""Token-range repack between two layouts of one cache that may differ in block size, block order and kernel
page size: the decode node places a prefill node's blocks, landed as they are in a staging buffer, into
its own blocks."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from kpool_pd.kernels.dispatch import on_tensor_device, use_triton
from kpool_pd.kernels.token_repack import ref
from kpool_pd.kvcache import BlockLayout, CacheConfig

# The CacheConfig fields in which the two sides may differ; every other field changes the meaning of bytes.
FREE_FIELDS = ("block_size", "order", "kernel_page_states")


def check_layouts(src_layout: BlockLayout, dst_layout: BlockLayout) -> None:
    """TypeError unless both are BlockLayouts; ValueError naming the fields (with both values) in which
    their configs differ, other than ``FREE_FIELDS``."""
    for name, layout in (("src_layout", src_layout), ("dst_layout", dst_layout)):
        if not isinstance(layout, BlockLayout):
            raise TypeError(f"{name} must be a BlockLayout, got {type(layout).__name__}")
    _check_pair(src_layout, dst_layout)


@functools.lru_cache(maxsize=64)
def _check_pair(src_layout: BlockLayout, dst_layout: BlockLayout) -> None:
    """``check_layouts``' comparison of the configs, once per pair of layouts (kept alive here, so an id is never
    reused while cached; a pair that fails raises again at every call: exceptions are not cached)."""
    src, dst = src_layout.config, dst_layout.config
    # Field by field (not a replace(): the source's fields with the destination's block size may not make a config).
    differ = {f.name: (getattr(src, f.name), getattr(dst, f.name)) for f in dataclasses.fields(CacheConfig)
              if f.name not in FREE_FIELDS and getattr(src, f.name) != getattr(dst, f.name)}
    if differ:
        raise ValueError(
            f"the layouts may differ only in {list(FREE_FIELDS)}; they also differ in {sorted(differ)} "
            f"(src, dst): {differ}"
        )


def _check_blocks(name: str, blocks: torch.Tensor, layout: BlockLayout) -> None:
    if not isinstance(blocks, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(blocks).__name__}")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != layout.block_bytes \
            or blocks.stride(1) != 1 or blocks.stride(0) != layout.block_bytes:
        raise ValueError(
            f"{name} must be contiguous uint8 [num_blocks, block_bytes={layout.block_bytes}], "
            f"got {blocks.dtype} {list(blocks.shape)} with strides {blocks.stride()}"
        )


def _ids(name: str, ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 or int64 tensor, got {ids.dtype} {list(ids.shape)}")
        if ids.device != device:
            raise ValueError(f"{name} is on {ids.device}, the blocks on {device}")
        return ids.contiguous()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{name} must be a tensor or a sequence of ints, got {type(ids).__name__}")
    values = list(ids)
    if not all(type(v) is int for v in values):  # bool (an int subclass) is refused too
        raise TypeError(f"{name} must be a tensor or a sequence of ints, got {values!r}")
    return block_ids_on(values, device)


def block_ids_on(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """A block table of ints on ``device``, for ``repack_tokens``: to a GPU from pinned memory without waiting
    (a pageable copy would wait for the stream's work in flight). A caller that knows the ids before the blocks
    are ready makes the table then, and the repack launches without a copy.

    # ids: n ints -> [n] int64 on device
    """
    table = torch.tensor(list(ids), dtype=torch.int64)
    return table.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else table


def _check_overlap(src_blocks: torch.Tensor, dst_blocks: torch.Tensor) -> None:
    src_start, dst_start = src_blocks.data_ptr(), dst_blocks.data_ptr()
    src_end, dst_end = src_start + src_blocks.numel(), dst_start + dst_blocks.numel()
    if src_blocks.numel() and dst_blocks.numel() and src_start < dst_end and dst_start < src_end:
        raise ValueError(f"src_blocks [{src_start:#x}, {src_end:#x}) and dst_blocks [{dst_start:#x}, {dst_end:#x}) "
                         "overlap")


def _check_ids_on_host(src_ids: torch.Tensor, src_count: int, dst_ids: torch.Tensor, dst_count: int) -> None:
    """The id values (CPU tensors only: reading them would synchronise with a GPU)."""
    for name, ids, count in (("src_block_ids", src_ids, src_count), ("dst_block_ids", dst_ids, dst_count)):
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= count:
                raise ValueError(f"{name} must lie in [0, {count}), got range [{low}, {high}] in {ids.tolist()}")
    if dst_ids.unique().numel() != dst_ids.numel():
        raise ValueError(f"dst_block_ids name a block twice: {dst_ids.tolist()}")


@on_tensor_device
def repack_tokens(
    src_blocks: torch.Tensor, src_layout: BlockLayout, src_block_ids: torch.Tensor | Sequence[int],
    dst_blocks: torch.Tensor, dst_layout: BlockLayout, dst_block_ids: torch.Tensor | Sequence[int],
    num_tokens: int,
) -> None:
    """Copy every layer's entries of token positions ``[0, num_tokens)`` of a request from its source blocks
    (block table ``src_block_ids``: positions ``[i * A, (i + 1) * A)`` live in block ``src_block_ids[i]``,
    ``A`` the source block size) into its destination blocks (``dst_block_ids``, block size ``B``).

    Moved: the MLA rows of those tokens; each kpool state (its 128 fp8 bytes and its fp32 scale) whose first
    token is below ``num_tokens``, i.e. states ``[0, ceil(num_tokens / kpool))``; likewise the QSA compressed
    rows ``[0, ceil(num_tokens / r))``. Nothing else of ``dst_blocks`` is written: other blocks, rows past the
    range and the padding between pages keep their bytes. Rings are not blocks and are not touched.

    The layouts must describe one cache, differing at most in ``block_size``, ``order`` and
    ``kernel_page_states`` (any pair of block sizes). Equal block sizes and ``num_tokens = n * A`` give the
    bytes of ``kernels.repack_blocks`` over the first ``n`` ids. Called by the connector's decode side once
    a peer's blocks have landed in a staging buffer; pure byte movement, so every path gives the same bytes.
    Triton on CUDA tensors (a few launches, no host synchronisation once the ids are tensors on the device),
    the torch reference on CPU (see kernels.dispatch). The buffers must not overlap.

    Only the first ``ceil(num_tokens / A)`` source ids and ``ceil(num_tokens / B)`` destination ids are read.
    ValueError/TypeError for: layouts that differ in other fields (named), buffers of the wrong dtype, shape
    or strides, on other devices or overlapping, id tensors of the wrong dtype, rank or device, a block
    table too short for ``num_tokens``, ``num_tokens`` not an int >= 0; on CPU tensors also for read ids
    outside their pool and a destination block named twice (on CUDA such a row is skipped, resp. either
    source wins).

    # src_blocks: [Ns, src block_bytes] uint8; dst_blocks: [Nd, dst block_bytes] uint8 (in place);
    # src_block_ids: [>= ceil(n / A)] int; dst_block_ids: [>= ceil(n / B)] int (device tensors or ints); n = num_tokens
    """
    check_layouts(src_layout, dst_layout)
    _check_blocks("src_blocks", src_blocks, src_layout)
    _check_blocks("dst_blocks", dst_blocks, dst_layout)
    if src_blocks.device != dst_blocks.device:
        raise ValueError(f"src_blocks are on {src_blocks.device}, dst_blocks on {dst_blocks.device}")
    _check_overlap(src_blocks, dst_blocks)
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool):
        raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__} {num_tokens!r}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    src_ids = _ids("src_block_ids", src_block_ids, src_blocks.device)
    dst_ids = _ids("dst_block_ids", dst_block_ids, src_blocks.device)
    for name, ids, layout in (("src", src_ids, src_layout), ("dst", dst_ids, dst_layout)):
        block_size = layout.config.block_size
        if ids.shape[0] * block_size < num_tokens:
            raise ValueError(
                f"{name}_block_ids hold {ids.shape[0]} blocks of {block_size} tokens = {ids.shape[0] * block_size} "
                f"tokens, fewer than num_tokens {num_tokens}"
            )
    src_used = src_ids[:-(-num_tokens // src_layout.config.block_size)]
    dst_used = dst_ids[:-(-num_tokens // dst_layout.config.block_size)]
    if not src_blocks.is_cuda:
        _check_ids_on_host(src_used, src_blocks.shape[0], dst_used, dst_blocks.shape[0])
    if use_triton(src_blocks):
        from kpool_pd.kernels.token_repack.triton import repack_tokens_triton

        repack_tokens_triton(src_blocks, src_layout, src_used, dst_blocks, dst_layout, dst_used, num_tokens)
        return
    ref.repack_tokens(src_blocks, src_layout, src_used, dst_blocks, dst_layout, dst_used, num_tokens)


__all__ = ["repack_tokens"]
