"""The global top-k of a DCP decode instance: the top-k of the union of every rank's top-k.

Each rank scores only its own pools; the pool set that a single rank holding everything would
select is the top-k of the union of the per-rank top-k (a pool in the global top-k has fewer than
k better pools anywhere, so fewer than k on its own rank), ordered by score, ties to the lower
pool index, exactly as the single-rank top-k orders them. Scores are per pool (a pool's score
never depends on which other pools are scored), so the result is independent of the rank count.
"""

from __future__ import annotations

import torch

from kpool_pd.model.dcp_group import DcpGroup


def merge_topk(pools: torch.Tensor, scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k of the union of the ranks' candidates, best first, ties to the lower pool index.

    # pools: [N, Q, k] int64 (-1 = none); scores: [N, Q, k] fp32 (-inf where none) -> [Q, topk] int64 (-1 padded)
    """
    ranks, rows, width = pools.shape
    pools = pools.permute(1, 0, 2).reshape(rows, ranks * width)
    scores = scores.permute(1, 0, 2).reshape(rows, ranks * width)
    none = pools < 0
    by_pool = torch.sort(torch.where(none, torch.iinfo(torch.int64).max, pools), dim=1, stable=True).indices
    pools, scores = torch.gather(pools, 1, by_pool), torch.gather(scores, 1, by_pool)
    scores = torch.where(torch.gather(none, 1, by_pool), float("-inf"), scores)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :topk]
    chosen = torch.gather(pools, 1, order)
    chosen = torch.where(torch.gather(scores, 1, order) == float("-inf"), -1, chosen)
    if chosen.shape[1] < topk:
        chosen = torch.cat([chosen, chosen.new_full((rows, topk - chosen.shape[1]), -1)], dim=1)
    return chosen


def join_topk(group: DcpGroup, pools: torch.Tensor, scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The global top-k from this rank's; one collective (an all-gather of pools and score bits).

    # pools: [Q, k] int64 global pool indices (-1 = none); scores: [Q, k] fp32 -> [Q, topk] int64
    """
    bits = scores.contiguous().view(torch.int32).to(torch.int64)
    both = group.all_gather(torch.stack([pools, bits], dim=0))  # [N, 2, Q, k]
    gathered_scores = both[:, 1].to(torch.int32).view(torch.float32)
    return merge_topk(both[:, 0], gathered_scores, topk)
