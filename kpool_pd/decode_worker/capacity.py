"""How many blocks the decode daemon's cache holds: ``num-blocks`` where given; else, with
``gpu-memory-fraction`` (vLLM's ``gpu_memory_utilization``), what that share of the GPU leaves once
the GPU's memory in use now, the rings (one per ``max-running`` request) and a workspace for the model's
weights, its decode graphs and a step's tensors are taken; else enough for ``max-running`` of the
largest requests (``max-prompt-tokens`` + ``max-new-tokens``).

More blocks than ``max-running`` requests need let the queue's requests find room sooner; requests
that fit wait in the queue either way (``DecodeScheduler``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from kpool_pd.decode_worker.dcp_options import dcp_config
from kpool_pd.kvcache import BlockLayout
from kpool_pd.runtime import model_config
from kpool_pd.runtime.options import SettingsError
from kpool_pd.runtime.settings import source_of

WORKSPACE_BYTES = 1 << 30  # the model's weights, its decode graphs and a step's tensors, beside the cache
GIB = 1 << 30

Memory = Callable[[torch.device], tuple[int, int]]  # (free, total) bytes of a device


def cuda_memory(device: torch.device) -> tuple[int, int]:
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def largest_request_blocks(settings: Mapping[str, Any]) -> int:
    """Blocks of one rank for the largest request the settings accept."""
    config, dcp = model_config(settings), dcp_config(settings)
    return dcp.rank_blocks_for_request(config.cache, settings["max_prompt_tokens"], settings["max_new_tokens"])


def fraction_blocks(settings: Mapping[str, Any], device: torch.device, memory: Memory = cuda_memory) -> int:
    """Blocks that ``gpu-memory-fraction`` of ``device`` leaves for the cache; SettingsError naming the
    fraction, the device's memory and what is in use where it leaves too few for one largest request."""
    fraction = settings["gpu_memory_fraction"]
    where = f"gpu-memory-fraction {fraction} ({source_of(settings, 'gpu_memory_fraction')})"
    if torch.device(device).type != "cuda":
        raise SettingsError(f"{where}: sizes the cache from a GPU's memory; the device is {device} (give num-blocks)")
    if dcp_config(settings).size > 1:
        raise SettingsError(f"{where}: every DCP rank needs the same number of blocks; give num-blocks with dcp > 1")
    layout = BlockLayout(model_config(settings).cache)
    free, total = memory(torch.device(device))
    rings = settings["max_running"] * layout.ring_block_bytes
    budget = int(fraction * total) - (total - free) - WORKSPACE_BYTES - rings
    blocks = max(budget, 0) // layout.block_bytes
    need = largest_request_blocks(settings)
    if blocks < need:
        raise SettingsError(f"{where}: {fraction} of {total / GIB:.1f} GiB less {(total - free) / GIB:.1f} GiB in use, "
                            f"{WORKSPACE_BYTES / GIB:.0f} GiB of workspace and {rings / GIB:.2f} GiB of rings leaves "
                            f"{blocks} blocks of {layout.block_bytes} bytes; the largest request needs {need}")
    return blocks


def rank_cache_blocks(settings: Mapping[str, Any], device: torch.device | str = "cpu",
                      memory: Memory = cuda_memory) -> int:
    """Blocks of each rank's cache (the module's rule)."""
    if settings["num_blocks"]:
        return settings["num_blocks"]
    if settings["gpu_memory_fraction"]:
        return fraction_blocks(settings, torch.device(device), memory)
    return settings["max_running"] * largest_request_blocks(settings)
