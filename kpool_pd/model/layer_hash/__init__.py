"""One layer's step of the target model's chained hash, fused: the new hash of each query row from its
top-k selection and the cache bytes, with no features tensor (``ref.py`` defines the features).

``kpool_layer_hash`` and ``qsa_layer_hash`` run the Triton kernel on CUDA tensors (or on CPU tensors under
``KPOOL_PD_FORCE_TRITON=1`` in Triton's interpreter), the torch reference otherwise (``kpool_pd.kernels.dispatch``).
Called by the families' ``chain`` once per layer of every forward that asks for next tokens. Arguments are
checked by shape, dtype and device only (no value is read on the host), so the CUDA path never synchronises
and captures in a CUDA graph; a ValueError or TypeError names the offending values. Indices that name
nothing (-1) read nothing.
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.checks import check_int_tensor, check_same_device, check_tensor
from kpool_pd.kernels.dispatch import on_tensor_device, use_triton
from kpool_pd.kernels.kpool_checks import check_indexer_page
from kpool_pd.kvcache import FP8_ENTRY_BYTES
from kpool_pd.model.layer_hash import ref


def _check_rows(acc: torch.Tensor, selection: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                ring_ids: torch.Tensor, ring_rows: torch.Tensor, mla: torch.Tensor, name: str) -> None:
    """Checks shared by both families: Q rows of every per-row argument, the byte views' ranks."""
    check_tensor("acc", acc, dtype=torch.int64, rank=1)
    rows = acc.shape[0]
    check_tensor(name, selection, dtype=torch.int64, rank=2)
    check_int_tensor("seq_lens", seq_lens, 1)
    check_int_tensor("block_table", block_table, 2)
    check_int_tensor("ring_ids", ring_ids, 1)
    sizes = {name: selection.shape[0], "seq_lens": seq_lens.shape[0], "block_table": block_table.shape[0],
             "ring_ids": ring_ids.shape[0]}
    if any(size != rows for size in sizes.values()):
        raise ValueError(f"acc has {rows} rows; every per-row argument needs as many, got {sizes}")
    check_tensor("ring_rows", ring_rows, dtype=torch.uint8, rank=3)
    check_tensor("mla", mla, dtype=torch.uint8, rank=4)


def _check_weights(weights: torch.Tensor, width: int) -> None:
    check_tensor("weights", weights, dtype=torch.int64, rank=1)
    if weights.shape[0] != width:
        raise ValueError(f"weights has {weights.shape[0]} entries, the features of these arguments are {width} wide")


def _check_group(name: str, value: int, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


@on_tensor_device
def kpool_layer_hash(acc: torch.Tensor, weights: torch.Tensor, pools: torch.Tensor, seq_lens: torch.Tensor,
                     block_table: torch.Tensor, ring_ids: torch.Tensor, indexer_q: torch.Tensor,
                     indexer_scale: torch.Tensor, ring_rows: torch.Tensor, mla: torch.Tensor, *,
                     kpool: int) -> torch.Tensor:
    """The chained hash of each row after this layer: ``fold_layer(acc, weights, kpool_features(...))``.

    # acc: [Q] int64 in [0, P); weights: [F] int64 (the layer's row of the rule's weights)
    # pools: [Q, K] int64 (``kpool_indexer_topk``'s, -1 = none); seq_lens: [Q] int; block_table: [Q, M] int
    # ring_ids: [Q] int (-1 = none); indexer_q: [num_blocks, pages, states_per_page, 128] fp8
    # indexer_scale: [num_blocks, pages, states_per_page] fp32; ring_rows: [num_rings, ring_slots, row_bytes] uint8
    # (``kpool_pd.model.cache_io.layer_ring_rows``); mla: [num_blocks, block_size, H, E] uint8 (``CachePool.mla``)
    # -> [Q] int64 in [0, P)
    """
    _check_rows(acc, pools, seq_lens, block_table, ring_ids, ring_rows, mla, "pools")
    states = check_indexer_page(indexer_q, indexer_scale)
    _check_group("kpool", kpool, 2)
    if states * kpool != mla.shape[1]:
        raise ValueError(f"indexer blocks of {states} states of kpool {kpool} hold {states * kpool} tokens, "
                         f"MLA blocks {mla.shape[1]}")
    topk = pools.shape[1]
    _check_weights(weights, topk + topk * FP8_ENTRY_BYTES + (kpool - 1) * ring_rows.shape[2]
                   + (topk * kpool + kpool - 1) * mla.shape[2] * mla.shape[3])
    check_same_device(acc=acc, weights=weights, pools=pools, seq_lens=seq_lens, block_table=block_table,
                      ring_ids=ring_ids, indexer_q=indexer_q, ring_rows=ring_rows, mla=mla)
    args = (acc, weights, pools, seq_lens, block_table, ring_ids, indexer_q, indexer_scale, ring_rows, mla)
    if use_triton(acc):
        from kpool_pd.model.layer_hash.triton import kpool_layer_hash_triton

        return kpool_layer_hash_triton(*args, kpool=kpool)
    return ref.kpool_layer_hash(*args, kpool=kpool)


@on_tensor_device
def qsa_layer_hash(acc: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, token_indices: torch.Tensor,
                   seq_lens: torch.Tensor, block_table: torch.Tensor, ring_ids: torch.Tensor, compressed: torch.Tensor,
                   ring_rows: torch.Tensor, mla: torch.Tensor, *, compress_ratio: int) -> torch.Tensor:
    """The chained hash of each row after this layer: ``fold_layer(acc, weights, qsa_features(...))``.

    # acc: [Q] int64 in [0, P); weights: [F] int64 (the layer's row of the rule's weights)
    # chosen: [Q, K] int64, token_indices: [Q, K * r + r - 1] int64 (``qsa_topk``'s, -1 = none); seq_lens: [Q] int
    # block_table: [Q, M] int; ring_ids: [Q] int (-1 = none); compressed: [num_blocks, block_size / r, H, D]
    # bf16 | fp8 (``CachePool.qsa_keys``); ring_rows: [num_rings, ring_slots, row_bytes] uint8
    # (``kpool_pd.model.cache_io.layer_ring_rows``); mla: [num_blocks, block_size, H', E] uint8 (``CachePool.mla``)
    # -> [Q] int64 in [0, P)
    """
    _check_rows(acc, chosen, seq_lens, block_table, ring_ids, ring_rows, mla, "chosen")
    _check_group("compress_ratio", compress_ratio, 1)
    topk, r = chosen.shape[1], compress_ratio
    check_tensor("token_indices", token_indices, dtype=torch.int64, shape=(acc.shape[0], topk * r + r - 1))
    if not isinstance(compressed, torch.Tensor) or compressed.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError(f"compressed must be a bf16 or fp8_e4m3fn tensor, got {getattr(compressed, 'dtype', None)}")
    check_tensor("compressed", compressed, rank=4)
    if compressed.shape[1] * r != mla.shape[1]:
        raise ValueError(f"compressed blocks of {compressed.shape[1]} rows of ratio {r} hold "
                         f"{compressed.shape[1] * r} tokens, MLA blocks {mla.shape[1]}")
    row_bytes = compressed.shape[2] * compressed.shape[3] * compressed.element_size()
    _check_weights(weights, topk + topk * row_bytes + (r - 1) * ring_rows.shape[2]
                   + (topk * r + r - 1) * mla.shape[2] * mla.shape[3])
    check_same_device(acc=acc, weights=weights, chosen=chosen, token_indices=token_indices, seq_lens=seq_lens,
                      block_table=block_table, ring_ids=ring_ids, compressed=compressed, ring_rows=ring_rows, mla=mla)
    args = (acc, weights, chosen, token_indices, seq_lens, block_table, ring_ids, compressed, ring_rows, mla)
    if use_triton(acc):
        from kpool_pd.model.layer_hash.triton import qsa_layer_hash_triton

        return qsa_layer_hash_triton(*args, compress_ratio=compress_ratio)
    return ref.qsa_layer_hash(*args, compress_ratio=compress_ratio)


__all__ = ["kpool_layer_hash", "qsa_layer_hash"]
