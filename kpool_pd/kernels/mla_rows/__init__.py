"""Write tokens' MLA entries (opaque bytes) into their paged rows, skipping tokens without a block."""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import check_int_tensor, check_same_device, check_tensor
from kpool_pd.kernels.dispatch import on_tensor_device, use_triton
from kpool_pd.kernels.mla_rows.ref import write_rows


@on_tensor_device
def write_mla_rows(mla: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, entries: torch.Tensor) -> None:
    """Store each token's entry at ``mla[block, offset, h]`` for every head h, in place; block -1 skips
    the token. CUDA tensors run one Triton launch with no host synchronisation (graph capturable), so the
    ranges of ``blocks`` and ``offsets`` are checked on CPU tensors only.

    # mla: [num_blocks, N, H, C] uint8 (CachePool.mla: C contiguous, any other strides)
    # blocks, offsets: [T] int (block -1 = skip); entries: [T, C] uint8
    """
    check_tensor("mla", mla, dtype=torch.uint8, rank=4)
    check_tensor("entries", entries, dtype=torch.uint8, shape=(None, mla.shape[3]))
    check_int_tensor("blocks", blocks, 1)
    check_int_tensor("offsets", offsets, 1)
    if mla.stride(3) != 1:
        raise ValueError(f"mla's entry bytes must be contiguous, got strides {mla.stride()}")
    if blocks.shape[0] != entries.shape[0] or offsets.shape[0] != entries.shape[0]:
        raise ValueError(f"blocks, offsets and entries need one row per token, got {blocks.shape[0]}, "
                         f"{offsets.shape[0]} and {entries.shape[0]}")
    check_same_device(mla=mla, blocks=blocks, offsets=offsets, entries=entries)
    if not mla.is_cuda and blocks.numel():
        live = blocks >= 0
        if bool((blocks[live] >= mla.shape[0]).any()) or bool(((offsets < 0) | (offsets >= mla.shape[1]))[live].any()):
            raise ValueError(f"blocks must lie in [-1, {mla.shape[0]}) and offsets in [0, {mla.shape[1]}), got "
                             f"blocks {blocks.tolist()[:8]} and offsets {offsets.tolist()[:8]}")
    if use_triton(mla):
        from kpool_pd.kernels.mla_rows.triton import write_rows_triton

        write_rows_triton(mla, blocks, offsets, entries)
        return
    write_rows(mla, blocks, offsets, entries)
