"""``gpu-memory-fraction`` on a real GPU: the cache it sizes is allocated, and the process then holds at
most its share of the device (the workspace left for the model included)."""

from __future__ import annotations

import pytest
import torch

from kpool_pd.decode_worker.capacity import WORKSPACE_BYTES, rank_cache_blocks
from kpool_pd.kvcache import BlockLayout, NodeCache
from kpool_pd.model import Engine
from kpool_pd.runtime import model_config
from tests.workers.test_decode_capacity import settings

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_whole_device, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_fraction_sizes_a_cache_that_fits_its_share():
    device = torch.device("cuda", 0)
    s = settings(gpu_memory_fraction=0.1, max_running=16, layers=61)
    blocks = rank_cache_blocks(s, device)
    _, total = torch.cuda.mem_get_info(device)
    config = model_config(s)
    cache = NodeCache(BlockLayout(config.cache), num_blocks=blocks, num_rings=16, device=device)
    engine = Engine(config, cache.pool, graph_requests=16)
    engine.capture_graphs()
    free_after, _ = torch.cuda.mem_get_info(device)
    used = total - free_after
    assert used <= 0.1 * total, (used, total)
    rings = 16 * cache.pool.layout.ring_block_bytes
    assert used >= 0.1 * total - WORKSPACE_BYTES - rings, (used, total)  # the share is used, less the workspace
