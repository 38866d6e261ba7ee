"""Reference paged indexer scoring: score_j = sum_h w_h * relu(q_h . dequant(k_j)) over the
complete pools of each request whose block is held, then top-k (ties go to the lower pool index).
A pool's score is the same bits whichever other pools are scored with it."""

from __future__ import annotations

import torch

from kpool_pd.kernels.kpool_cache.ref import block_states, dequantize_entries, pool_slots


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
    indexer_q: torch.Tensor, indexer_scale: torch.Tensor, *, kpool: int, topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """# q: [B, H, 128] bf16; weights: [B, H] fp32; seq_lens: [B] int; block_table: [B, M] int
    # -> pools: [B, topk] int64 (pool indices, best first, -1 padded), scores: [B, topk] fp32 (-inf padded)
    """
    batch, states = q.shape[0], block_states(indexer_q)
    pools_out = torch.full((batch, topk), -1, dtype=torch.int64, device=q.device)
    scores_out = torch.full((batch, topk), float("-inf"), dtype=torch.float32, device=q.device)
    for b, length in enumerate(seq_lens.tolist()):
        complete = length // kpool
        if complete == 0:
            continue
        pool_ids = torch.arange(complete, device=q.device)
        slots = pool_slots(block_table[b:b + 1], pool_ids[None], kpool=kpool, states=states)[0]
        held = slots >= 0  # a pool whose block is -1 (or past the table) is no candidate
        pool_ids, slots = pool_ids[held], slots[held]
        if pool_ids.numel() == 0:
            continue
        keys = dequantize_entries(indexer_q, indexer_scale, slots)  # [complete, 128]
        # Each pool's logits are an elementwise product summed over the head dim, not a matmul, whose
        # summation order can change with the number of pools: a pool's score must not depend on
        # which other pools are scored (a decode-context-parallel rank scores only its own).
        logits = torch.relu((q[b].to(torch.float32)[:, None, :] * keys[None]).sum(dim=2))  # [H, complete]
        scores = (weights[b].to(torch.float32)[:, None] * logits).sum(dim=0)
        order = torch.sort(-scores, stable=True).indices[:topk]
        pools_out[b, : order.numel()] = pool_ids[order]
        scores_out[b, : order.numel()] = scores[order]
    return pools_out, scores_out
