"""Argument checks shared by the kpool ops' public entry points."""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import check_int_tensor, check_tensor
from kpool_pd.kvcache import INDEX_HEAD_DIM


def check_token_batch(k: torch.Tensor, gate: torch.Tensor, query_start_loc: torch.Tensor) -> int:
    """Shared checks of a packed token batch; returns the batch size B."""
    check_tensor("k", k, dtype=torch.bfloat16, shape=(None, INDEX_HEAD_DIM))
    check_tensor("gate", gate, dtype=torch.bfloat16, shape=tuple(k.shape))
    check_int_tensor("query_start_loc", query_start_loc, 1)
    if query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc must hold B+1 offsets, got an empty tensor")
    return query_start_loc.shape[0] - 1


def check_indexer_page(indexer_q: torch.Tensor, indexer_scale: torch.Tensor) -> int:
    """The indexer cache views in kernel pages (``CachePool.indexer_q`` / ``indexer_scale``); returns the
    states per block S = pages * states_per_page.

    # indexer_q: [num_blocks, pages, states_per_page, 128] fp8; indexer_scale: [num_blocks, pages, states_per_page] fp32
    """
    check_tensor("indexer_q", indexer_q, dtype=torch.float8_e4m3fn, shape=(None, None, None, INDEX_HEAD_DIM))
    check_tensor("indexer_scale", indexer_scale, dtype=torch.float32, shape=tuple(indexer_q.shape[:3]))
    if indexer_q.shape[1] < 1 or indexer_q.shape[2] < 1:
        raise ValueError(f"indexer_q needs at least one page of one state a block, got shape {tuple(indexer_q.shape)}")
    return indexer_q.shape[1] * indexer_q.shape[2]


def check_kpool_cache(ape: torch.Tensor, indexer_q: torch.Tensor, indexer_scale: torch.Tensor) -> int:
    """Shared checks of ape and the indexer page views; returns kpool."""
    check_tensor("ape", ape, dtype=torch.float32, shape=(None, INDEX_HEAD_DIM))
    if ape.shape[0] < 2:
        raise ValueError(f"ape must be [kpool >= 2, {INDEX_HEAD_DIM}], got {tuple(ape.shape)}")
    check_indexer_page(indexer_q, indexer_scale)
    return ape.shape[0]


def check_tail_ring(tail_ring: torch.Tensor, kpool: int) -> None:
    check_tensor("tail_ring", tail_ring, dtype=torch.bfloat16, shape=(None, 2, None, INDEX_HEAD_DIM))
    if tail_ring.shape[2] % kpool:
        raise ValueError(f"tail ring size {tail_ring.shape[2]} is not a multiple of kpool {kpool}")
