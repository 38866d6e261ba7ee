"""Block repack between the BLNHC and BLHNC orders, for a connector whose peer stores the other order."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.dispatch import on_tensor_device, use_triton
from kernels.block_repack import ref
from kvcache import BlockLayout


def _ids(name: str, ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 or int64 tensor, got {ids.dtype} {list(ids.shape)}")
        if ids.device != device:
            raise ValueError(f"{name} is on {ids.device}, the blocks on {device}")
        return ids.contiguous()
    values = list(ids)
    if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
        raise TypeError(f"{name} must be a tensor or a sequence of ints, got {values!r}")
    return torch.tensor(values, dtype=torch.int64, device=device)


def _check_blocks(name: str, blocks: torch.Tensor, layout: BlockLayout) -> None:
    if not isinstance(blocks, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(blocks).__name__}")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != layout.block_bytes \
            or blocks.stride(1) != 1 or blocks.stride(0) != layout.block_bytes:
        raise ValueError(
            f"{name} must be contiguous uint8 [num_blocks, block_bytes={layout.block_bytes}], "
            f"got {blocks.dtype} {list(blocks.shape)} with strides {blocks.stride()}"
        )


@on_tensor_device
def repack_blocks(
    src_blocks: torch.Tensor, src_layout: BlockLayout, src_block_ids: torch.Tensor | Sequence[int],
    dst_blocks: torch.Tensor, dst_layout: BlockLayout, dst_block_ids: torch.Tensor | Sequence[int],
) -> None:
    """Copy blocks ``src_block_ids[i]`` of one pool into blocks ``dst_block_ids[i]`` of another whose layout
    differs at most in ``order`` (BLNHC / BLHNC), converting each MLA and QSA compressed-key page.

    Called by the connector when it unpacks a peer's blocks into its own; pure byte movement, so both
    paths give the same bytes. Triton on CUDA tensors (no host synchronisation once the ids are
    tensors on the device), the torch reference on CPU (see kernels.dispatch). Only the pages are
    written (not the padding between them). The two buffers must not overlap. ValueError/TypeError
    for layouts that differ in more than the order, wrong buffers, or id lists of different lengths;
    on CPU tensors also for ids outside their pool and a destination block named twice (on CUDA such
    a pair is skipped, resp. either source wins).

    # src_blocks: [Ns, src block_bytes] uint8; dst_blocks: [Nd, dst block_bytes] uint8 (in place);
    # src_block_ids, dst_block_ids: [n] int (tensors on the blocks' device, or sequences of ints)
    """
    ref.check_layouts(src_layout, dst_layout)
    _check_blocks("src_blocks", src_blocks, src_layout)
    _check_blocks("dst_blocks", dst_blocks, dst_layout)
    if src_blocks.device != dst_blocks.device:
        raise ValueError(f"src_blocks are on {src_blocks.device}, dst_blocks on {dst_blocks.device}")
    src_ids = _ids("src_block_ids", src_block_ids, src_blocks.device)
    dst_ids = _ids("dst_block_ids", dst_block_ids, src_blocks.device)
    if src_ids.shape[0] != dst_ids.shape[0]:
        raise ValueError(f"src_block_ids has {src_ids.shape[0]} ids, dst_block_ids {dst_ids.shape[0]}")
    if not src_blocks.is_cuda and src_ids.numel():
        for name, ids, count in (("src_block_ids", src_ids, src_blocks.shape[0]),
                                 ("dst_block_ids", dst_ids, dst_blocks.shape[0])):
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= count:
                raise ValueError(f"{name} must lie in [0, {count}), got range [{low}, {high}]")
        if dst_ids.unique().numel() != dst_ids.numel():
            raise ValueError(f"dst_block_ids name a block twice: {dst_ids.tolist()}")
    if use_triton(src_blocks):
        from kernels.block_repack.triton import repack_blocks_triton

        repack_blocks_triton(src_blocks, src_layout, src_ids, dst_blocks, dst_layout, dst_ids)
        return
    ref.repack_blocks(src_blocks, src_layout, src_ids, dst_blocks, dst_layout, dst_ids)


__all__ = ["repack_blocks"]
