"""The transfer bench's prefill engine writes a prompt whole or in chunks, saying how far after each chunk."""

import asyncio

import pytest
import torch

from kpool_pd.bench.transfer_connector import _TemplateEngine, bench_config
from kpool_pd.connector import PrefillInput
from kpool_pd.kvcache import BlockLayout, NodeCache


class _Progress:
    def __init__(self):
        self.allocation, self.advanced = None, []

    def serve_from(self, allocation):
        self.allocation = allocation

    def advance(self, tokens):
        self.advanced.append(tokens)


@pytest.mark.parametrize("chunk, advanced", [(0, [1500]), (512, [512, 1024, 1500]), (4096, [1500])])
def test_the_prompt_is_written_from_the_template_chunk_by_chunk(chunk, advanced):
    config = bench_config(2, 256, 4)
    cache = NodeCache(BlockLayout(config), num_blocks=12, num_rings=1, device="cpu")
    template = torch.randint(0, 256, (12, cache.pool.layout.block_bytes), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(3))
    progress = _Progress()
    engine = _TemplateEngine(cache, template, compute_s=0.001, chunk_tokens=chunk)
    out = asyncio.run(engine.prefill(PrefillInput(request_id="r", prompt_token_ids=[1] * 1500), progress))
    assert out.prompt_len == 1500 and progress.advanced == advanced
    ids = list(progress.allocation.block_ids)
    assert len(ids) == config.blocks_for_tokens(1500) == 6
    assert torch.equal(cache.pool.blocks[ids], template[:6])
