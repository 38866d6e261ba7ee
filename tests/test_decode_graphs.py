"""What the decode graphs decide on the host (their replay is tests/gpu/test_decode_graphs_gpu.py's): the
buckets a step is padded to, and the engines they refuse."""

from __future__ import annotations

import pytest
import torch

from kvcache import BlockLayout, CacheFamily, CachePool
from model import ModelConfig
from model.decode_graphs import bucket_size
from model.engine import Engine


def test_buckets_are_the_next_power_of_two():
    assert [bucket_size(n) for n in (0, 1, 2, 3, 4, 5, 16, 17, 64)] == [1, 1, 2, 4, 4, 8, 16, 32, 64]


@pytest.mark.parametrize("family", list(CacheFamily), ids=lambda f: f.value)
def test_a_cpu_engine_refuses_graphs(family):
    config = ModelConfig.build(family=family, num_layers=1)
    pool = CachePool(BlockLayout(config.cache), num_blocks=2, num_rings=1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=f"decode graphs serve kpool pools on CUDA; this engine's pool is "
                                         f"{family.value} on cpu"):
        Engine(config, pool, graph_requests=4)
