"""Kernel bench cases of the token repack (kernels.repack_tokens): a whole 61-layer, 32k-token request placed
from a staging buffer of the prefill node's layout into the decode node's blocks, bytes read + written
against the device copy; and the same-size case of an order conversion."""

from __future__ import annotations

from dataclasses import replace

import torch

from kpool_pd.bench.timing import BenchCase, Prepared
from kpool_pd.kernels import repack_tokens
from kpool_pd.kvcache import BlockLayout, BlockOrder, CacheConfig, CacheDtype, CacheFamily

LAYERS = tuple(f"layer.{i}" for i in range(61))
TOKENS = 32_768
KPOOL_CONFIG = CacheConfig(family=CacheFamily.KPOOL, layer_names=LAYERS, kpool=4, block_size=256)
QSA_CONFIG = CacheConfig(family=CacheFamily.QSA, layer_names=LAYERS, compress_ratio=4, qsa_num_heads=8,
                         qsa_dtype=CacheDtype.BFLOAT16, block_size=256)


def moved_bytes(layout: BlockLayout, tokens: int) -> int:
    """Bytes one repack of ``tokens`` reads plus writes: every field's rows, heads and pieces, every layer."""
    return 2 * len(layout.layers) * sum(f.rows_for_tokens(tokens) * f.heads * f.piece_bytes for f in layout.fields)


def _tables(src_layout: BlockLayout, dst_layout: BlockLayout, tokens: int, device: torch.device):
    """Pools of exactly the request's blocks, block tables shuffled."""
    gen = torch.Generator().manual_seed(7)
    src_n = src_layout.config.blocks_for_tokens(tokens)
    dst_n = dst_layout.config.blocks_for_tokens(tokens)
    src = torch.randint(0, 256, (src_n, src_layout.block_bytes), dtype=torch.uint8, device=device)
    dst = torch.zeros(dst_n, dst_layout.block_bytes, dtype=torch.uint8, device=device)
    return src, torch.randperm(src_n, generator=gen).to(device), dst, torch.randperm(dst_n, generator=gen).to(device)


def make_token_repack(config: CacheConfig, src_changes: dict, dst_changes: dict, tokens: int = TOKENS):
    def make(device: torch.device) -> Prepared:
        src_layout, dst_layout = BlockLayout(replace(config, **src_changes)), BlockLayout(replace(config, **dst_changes))
        src, src_ids, dst, dst_ids = _tables(src_layout, dst_layout, tokens, device)
        return Prepared(lambda: repack_tokens(src, src_layout, src_ids, dst, dst_layout, dst_ids, tokens),
                        moved_bytes(src_layout, tokens))
    return make


_SIZE = "61 layers x 32,768 tokens"
REPACK_CASES: list[BenchCase] = [
    BenchCase(name="token repack 256->128, kpool 4", size=f"{_SIZE}, MLA 656 B (1.34 GB)",
              make=make_token_repack(KPOOL_CONFIG, {}, dict(block_size=128)), target_copy_fraction=0.80),
    BenchCase(name="token repack 128->512 P64->32, kpool 2", size=f"{_SIZE}, MLA 656 B",
              make=make_token_repack(replace(KPOOL_CONFIG, kpool=2), dict(block_size=128),
                                     dict(block_size=512, kernel_page_states=32)), target_copy_fraction=0.80),
    BenchCase(name="token repack 64->192, kpool 4", size=f"{_SIZE}, MLA 656 B",
              make=make_token_repack(KPOOL_CONFIG, dict(block_size=64), dict(block_size=192))),
    BenchCase(name="token repack 256->256 NHC->HNC, qsa 8 heads", size=f"{_SIZE}, r 4",
              make=make_token_repack(QSA_CONFIG, {}, dict(order=BlockOrder.BLHNC))),
    BenchCase(name="token repack 512->128 HNC->NHC, qsa 8 heads", size=f"{_SIZE}, r 4",
              make=make_token_repack(QSA_CONFIG, dict(block_size=512, order=BlockOrder.BLHNC), dict(block_size=128))),
]
