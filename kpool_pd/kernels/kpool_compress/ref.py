"""Reference kpool pool compression (DESIGN section 2), plain torch with fp32 math.

Every reduction runs in a fixed order (sequential over the pool's slots, butterflies for the
Hadamard) so that any implementation following the same order gets the same bytes.
"""

from __future__ import annotations

import torch

from kpool_pd.kernels.fp8 import quantize_fp8_rows
from kpool_pd.kernels.hadamard import INV_SQRT_DIM, fwht
from kpool_pd.kvcache import PoolMode


def pool_vectors(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, mode: PoolMode) -> torch.Tensor:
    """Step 1 of the compression: one fp32 vector per pool.

    # k, gate: [P, kpool, D] bf16; ape: [kpool, D] fp32 -> [P, D] fp32
    """
    kpool = k.shape[1]
    if mode is PoolMode.KEEP_LAST:
        return k[:, kpool - 1].to(torch.float32)
    logits = gate.to(torch.float32) + ape.to(torch.float32)[None]
    peak = logits[:, 0]
    for i in range(1, kpool):
        peak = torch.maximum(peak, logits[:, i])
    weights = [torch.exp(logits[:, i] - peak) for i in range(kpool)]
    total = weights[0]
    for i in range(1, kpool):
        total = total + weights[i]
    kf = k.to(torch.float32)
    x = (weights[0] / total) * kf[:, 0]
    for i in range(1, kpool):
        x = x + (weights[i] / total) * kf[:, i]
    return x


def compress_pools(
    k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, *, mode: PoolMode, round_scale: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress complete pools into fp8 indexer entries.

    # k, gate: [P, kpool, 128] bf16; ape: [kpool, 128] fp32 -> q: [P, 128] float8_e4m3fn, scale: [P] fp32
    """
    x = pool_vectors(k, gate, ape, mode).to(torch.bfloat16).to(torch.float32)
    y = (fwht(x) * INV_SQRT_DIM).to(torch.bfloat16).to(torch.float32)
    return quantize_fp8_rows(y, round_scale=round_scale)
