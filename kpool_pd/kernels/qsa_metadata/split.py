"""How a forward splits into uniform decodes and prefills (host integers, like vLLM's attention
metadata builders, read from the batch's host copies: no device synchronisation).

The batch is ordered decodes first (vLLM reorders it so). With ``decode_threshold = 1 + num_spec``
(a decode step is the last committed token and its drafts), the decodes are the leading requests
whose query length equals the first request's, when that length is at most the threshold; every
request from the first other length on counts as a prefill, even a short one, so the decodes all
have one query length (``decode_query_len``) and a decode kernel can treat them as a dense
``[num_decodes, decode_query_len]`` block. A batch whose first request is longer than the threshold
is all prefills.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class BatchSplit:
    """The host-side counts of one forward."""

    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    max_query_len: int
    decode_query_len: int  # the decodes' common query length; 0 without decodes
    max_seq_len: int
    num_actual_tokens: int  # query_start_loc[-1]: the real tokens, before any padding

    @property
    def num_requests(self) -> int:
        return self.num_decodes + self.num_prefills


def split_uniform_decodes(query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, *,
                          decode_threshold: int) -> BatchSplit:
    """The split of one forward (see the module docstring); ValueError for arguments that are not
    a batch's host copies.

    # query_start_loc_cpu: [B + 1] int (CPU); seq_lens_cpu: [B] int (CPU)
    """
    if isinstance(decode_threshold, bool) or not isinstance(decode_threshold, int) or decode_threshold < 1:
        raise ValueError(f"decode_threshold must be an integer >= 1, got {decode_threshold!r}")
    for name, t in (("query_start_loc_cpu", query_start_loc_cpu), ("seq_lens_cpu", seq_lens_cpu)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dim() != 1 or t.is_floating_point():
            raise ValueError(f"{name} must be a 1-D integer CPU tensor (the batch's host copy), got "
                             f"{getattr(t, 'shape', type(t).__name__)} on {getattr(t, 'device', '-')}")
    if query_start_loc_cpu.shape[0] != seq_lens_cpu.shape[0] + 1:
        raise ValueError(f"query_start_loc_cpu holds {query_start_loc_cpu.shape[0]} offsets for "
                         f"{seq_lens_cpu.shape[0]} requests (want requests + 1)")
    starts = query_start_loc_cpu.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    num_tokens = starts[-1] - starts[0] if starts else 0
    max_query_len = max(query_lens, default=0)
    max_seq_len = max(seq_lens_cpu.tolist(), default=0)
    first = query_lens[0] if query_lens else 0
    num_decodes = 0
    if 0 < first <= decode_threshold:
        while num_decodes < len(query_lens) and query_lens[num_decodes] == first:
            num_decodes += 1
    num_decode_tokens = starts[num_decodes] - starts[0] if query_lens else 0
    return BatchSplit(
        num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
        num_prefills=len(query_lens) - num_decodes, num_prefill_tokens=num_tokens - num_decode_tokens,
        max_query_len=max_query_len, decode_query_len=first if num_decodes else 0, max_seq_len=max_seq_len,
        num_actual_tokens=num_tokens,
    )
