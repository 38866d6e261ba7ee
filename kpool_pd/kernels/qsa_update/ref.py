"""One forward's QSA cache update: compress the completed groups, then stash the ring rows.

The same op serves a prefill chunk and a decode step (the last committed token plus its
drafts): both are a chunk ``[start, seq_len)`` of consecutive positions per request, and
``build_qsa_metadata`` already lists the groups that the chunk completes (``k_work``) and
the ring rows it writes.

For every work item (request ``b``, group ``g``) the op gathers the group's ``r`` raw keys:
positions inside the chunk from this forward's ``keys``, older positions from the request's
ring (only the chunk's first group can straddle the boundary). The group's first MRoPE
position comes from this forward's ``positions``, or, for an older first token, from the
ring's packed positions (``cache_rope_positions``) or else the text position
``(p, p, p)``. The group is compressed (``kpool_pd.kernels.qsa_compress``) and written to its row of
the compressed cache. **Only then** are the ring rows written.

Reads before writes is required, not a convenience: a prefill chunk longer than ``C`` writes
its last ``C`` tokens to the ring, and those rows can be the very rows that hold the
straddling group's older keys. Example: ``r = C = 4``, the previous chunk ended at position
4 (ring row 0 holds position 4), this chunk covers positions 5..14; its group 1 (positions
4..7) needs position 4 from row 0, and position 12 is written to row 0 by this chunk.

A decode step's rejected drafts write garbage into ring rows and compressed rows past the
committed length; the next step rewrites them, and ``C >= r + num_spec`` guarantees that
a step never overwrites the committed open group that its redo reads.
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.qsa_compress.ref import compress_group_keys
from kpool_pd.kernels.qsa_metadata.ref import QsaMetadata
from kpool_pd.kernels.qsa_ring.ref import read_qsa_ring_positions, write_qsa_ring
from kpool_pd.kernels.qsa_rope.cache import RopeCache
from kpool_pd.kernels.qsa_rope.ref import text_positions

_BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


def qsa_forward_update(
    keys: torch.Tensor,
    positions: torch.Tensor,
    metadata: QsaMetadata,
    ring: torch.Tensor,
    compressed: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    compress_ratio: int,
    block_size: int,
    eps: float,
    rotary_dim: int,
    theta: float,
    section: tuple[int, int, int],
    cache_rope_positions: bool,
    rope_cache: RopeCache | None = None,
) -> None:
    # keys: [T, H, D] bf16; positions: [T, 3] int64; ring: [num_rings, C, H, W] bf16 (in place);
    # compressed: [num_blocks, block_size / r, H, D] bf16 | fp8_e4m3 (in place, any strides); norm_weight: [D] fp32
    """Write the compressed rows of every group this forward completes, then its ring rows.

    Called once per layer per forward, after the layer's keys are computed. Not idempotent
    in general: a second call sees the ring rows of the first. The math alone: the public op
    (``kpool_pd.kernels.qsa_update``) checks the arguments (``kpool_pd.kernels.qsa_update.checks``) before calling it.
    """
    r, cap = compress_ratio, metadata.ring_capacity
    rows_per_block = metadata.rows_per_block
    device = keys.device
    head_size = keys.shape[2]
    num_work = int(metadata.num_work[0])

    if num_work:
        q_start = metadata.query_start_loc.to(torch.int64)
        chunk_start = metadata.seq_lens.to(torch.int64) - (q_start[1:] - q_start[:-1])  # [B]
        work = metadata.k_work[:num_work].to(torch.int64)
        req = work[:, 0]
        group = chunk_start[req] // r + work[:, 1]  # [n] absolute group index
        start = chunk_start[req][:, None]
        group_pos = group[:, None] * r + torch.arange(r, device=device)  # [n, r]
        in_chunk = group_pos >= start
        token = q_start[req][:, None] + (group_pos - start)  # index into this forward's tokens

        # Gather the raw keys as bit patterns: chunk tokens, or ring rows for older positions.
        key_bits = keys.view(torch.int16)
        from_chunk = key_bits[token.clamp(min=0)]  # [n, r, H, D]; clamped rows are masked below
        ring_id = metadata.ring_blocks.to(torch.int64)[req][:, None]
        from_ring = ring.view(torch.int16)[ring_id, group_pos % cap][..., :head_size]
        group_keys = torch.where(in_chunk[:, :, None, None], from_chunk, from_ring).view(torch.bfloat16)

        first_pos = text_positions(group * r)  # [n, 3]; replaced below where known
        first_in_chunk = in_chunk[:, 0]
        first_pos[first_in_chunk] = positions[token[first_in_chunk, 0]]
        if cache_rope_positions:
            # At most one straddling group per request: read their packed positions one by one.
            for item in torch.nonzero(~first_in_chunk).flatten().tolist():
                slot = torch.tensor([int(group_pos[item, 0]) % cap], dtype=torch.int64, device=device)
                first_pos[item] = read_qsa_ring_positions(ring, int(ring_id[item, 0]), slot)[0]

        # The token that completes the group (the group's last) carries its compressed slot.
        slot = metadata.compressed_slot_mapping[token[:, r - 1]]
        assert bool((slot >= 0).all()), "k_work lists a group whose last token has no compressed slot"

        rows = compress_group_keys(
            group_keys, first_pos, norm_weight, eps=eps, rotary_dim=rotary_dim, theta=theta,
            section=section, out_dtype=compressed.dtype, rope_cache=rope_cache,
        )
        bits = _BITS[compressed.dtype]
        compressed.view(bits)[slot // rows_per_block, slot % rows_per_block] = rows.view(bits)

    write_qsa_ring(ring, keys, positions if cache_rope_positions else None, metadata.ring_slot_mapping)
