"""The decode daemon's cache size (decode_worker.capacity): num-blocks, a share of the GPU's memory, or
max-running of the largest requests; and the settings refused with one line naming the fraction."""

from __future__ import annotations

import pytest
import torch

from kpool_pd.decode_worker.capacity import WORKSPACE_BYTES, rank_cache_blocks
from kpool_pd.decode_worker.daemon import OPTIONS
from kpool_pd.kvcache import BlockLayout
from kpool_pd.runtime import Role, SettingsError, model_config
from kpool_pd.runtime.settings import load_settings

GIB = 1 << 30
CUDA = torch.device("cuda", 0)


def settings(**values) -> dict:
    argv = [part for key, value in values.items() for part in (f"--{key.replace('_', '-')}", str(value))]
    return load_settings(Role.DECODE, OPTIONS, argv, env={})


def test_without_a_fraction_the_cache_holds_max_running_of_the_largest_requests():
    s = settings(max_running=4, max_prompt_tokens=1000, max_new_tokens=100)
    assert rank_cache_blocks(s) == 4 * model_config(s).cache.blocks_for_request(1000, 100)
    assert rank_cache_blocks(settings(num_blocks=7, gpu_memory_fraction=0.5), CUDA, memory=lambda d: (0, 0)) == 7


def test_a_fraction_takes_what_is_left_of_its_share():
    s = settings(gpu_memory_fraction=0.5, max_running=8)
    layout = BlockLayout(model_config(s).cache)
    total, in_use = 100 * GIB, 10 * GIB
    blocks = rank_cache_blocks(s, CUDA, memory=lambda device: (total - in_use, total))
    budget = total // 2 - in_use - WORKSPACE_BYTES - 8 * layout.ring_block_bytes
    assert blocks == budget // layout.block_bytes
    more = rank_cache_blocks(settings(gpu_memory_fraction=0.9, max_running=8), CUDA,
                             memory=lambda device: (total - in_use, total))
    assert more > blocks


@pytest.mark.parametrize("values, device, message", [
    (dict(gpu_memory_fraction=0.5), "cpu", "sizes the cache from a GPU's memory; the device is cpu"),
    (dict(gpu_memory_fraction=0.1), "cuda", "leaves 0 blocks of"),
    (dict(gpu_memory_fraction=0.5, dcp=2), "cuda", "every DCP rank needs the same number of blocks"),
])
def test_refused_fractions_say_why(values, device, message):
    with pytest.raises(SettingsError, match="gpu-memory-fraction") as refused:
        rank_cache_blocks(settings(**values), torch.device(device), memory=lambda d: (10 * GIB, 10 * GIB))
    assert message in str(refused.value)


@pytest.mark.parametrize("text", ["-0.1", "1.5", "nan", "half"])
def test_a_fraction_outside_0_1_is_refused(text):
    with pytest.raises(SettingsError, match="gpu-memory-fraction"):
        settings(gpu_memory_fraction=text)
