"""Paged write and read-back of kpool indexer entries."""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import check_int_tensor, check_same_device, check_tensor
from kpool_pd.kernels.dispatch import on_tensor_device, use_triton
from kpool_pd.kernels.kpool_checks import check_indexer_page
from kpool_pd.kernels.kpool_cache.ref import dequantize_entries, page_index, pool_slots, read_entries, write_entries


def _check_slots(slots: torch.Tensor, count: int, indexer_q: torch.Tensor, *, allow_skip: bool) -> None:
    check_int_tensor("slots", slots, 1)
    if slots.shape[0] != count:
        raise ValueError(f"slots has {slots.shape[0]} entries, expected {count}")
    limit = indexer_q.shape[0] * indexer_q.shape[1] * indexer_q.shape[2]
    if not slots.is_cuda and slots.numel():  # values on CPU tensors only: CUDA calls never synchronise
        low, high = int(slots.min()), int(slots.max())
        if high >= limit or low < (-1 if allow_skip else 0):
            raise ValueError(f"slots must lie in [{-1 if allow_skip else 0}, {limit}), got range [{low}, {high}]")


@on_tensor_device
def kpool_write_entries(indexer_q, indexer_scale, q, scale, slots) -> None:
    """Write P entries into the paged indexer cache in place (slot -1 skips).

    # indexer_q: [num_blocks, pages, states_per_page, 128] fp8; indexer_scale: [num_blocks, pages, states_per_page]
    #   fp32 (slot = block * S + state, S = pages * states_per_page)
    # q: [P, 128] fp8; scale: [P] fp32; slots: [P] int32/int64
    """
    check_indexer_page(indexer_q, indexer_scale)
    check_tensor("q", q, dtype=torch.float8_e4m3fn, rank=2)
    check_tensor("scale", scale, dtype=torch.float32, shape=(q.shape[0],))
    _check_slots(slots, q.shape[0], indexer_q, allow_skip=True)
    check_same_device(indexer_q=indexer_q, q=q, scale=scale, slots=slots)
    if use_triton(indexer_q):
        from kpool_pd.kernels.kpool_cache.triton import write_entries_triton

        write_entries_triton(indexer_q, indexer_scale, q, scale, slots)
        return
    write_entries(indexer_q, indexer_scale, q, scale, slots)


@on_tensor_device
def kpool_read_entries(indexer_q, indexer_scale, slots, *, dequantize: bool = True):
    """Read P entries back: fp32 [P, 128] when dequantize, else (q fp8 [P, 128], scale fp32 [P]).

    # slots: [P] int32/int64 >= 0
    """
    check_indexer_page(indexer_q, indexer_scale)
    _check_slots(slots, slots.shape[0] if isinstance(slots, torch.Tensor) else 0, indexer_q, allow_skip=False)
    check_same_device(indexer_q=indexer_q, slots=slots)
    if use_triton(indexer_q):
        from kpool_pd.kernels.kpool_cache.triton import read_entries_triton

        return read_entries_triton(indexer_q, indexer_scale, slots, dequantize=dequantize)
    if dequantize:
        return dequantize_entries(indexer_q, indexer_scale, slots)
    return read_entries(indexer_q, indexer_scale, slots)


__all__ = ["kpool_read_entries", "kpool_write_entries", "page_index", "pool_slots"]
