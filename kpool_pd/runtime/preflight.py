"""Start-up checks of what the settings need from the machine, run before anything is built or
warmed up: the ready file's folder, and the memory a cache of the asked size takes. Each raises
``SettingsError`` naming the option and where its value came from (``kpool_pd.runtime.settings.source_of``),
so that the daemon exits with status 2 and one line instead of failing after its warm-up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kpool_pd.kvcache import BlockLayout
from kpool_pd.runtime.options import SettingsError
from kpool_pd.runtime.settings import source_of

MEMINFO = Path("/proc/meminfo")
GIB = 1 << 30


def check_ready_file(settings: Mapping[str, Any]) -> None:
    """The ready file's folder exists, is a folder, and this process may write in it."""
    path = settings.get("ready_file", "")
    if not path:
        return
    folder = Path(path).parent
    where = f"ready-file {path} ({source_of(settings, 'ready_file')})"
    if not folder.is_dir():
        raise SettingsError(f"{where}: its folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SettingsError(f"{where}: this process may not write in its folder {folder}")
    if Path(path).is_dir():
        raise SettingsError(f"{where}: is a folder")


def available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation on ``device`` may take: free GPU memory, or the host's
    ``MemAvailable``; None where it cannot be told."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cache_bytes(layout: BlockLayout, *, num_blocks: int, num_rings: int) -> int:
    """Bytes of a node cache of ``num_blocks`` blocks and ``num_rings`` ring blocks of ``layout``."""
    return num_blocks * layout.block_bytes + num_rings * layout.ring_block_bytes


def check_cache_memory(settings: Mapping[str, Any], option: str, layout: BlockLayout, *, num_blocks: int,
                       num_rings: int, device: torch.device | str, copies: int = 1) -> None:
    """The cache (``copies`` of it on this machine's memory: one per DCP rank on the CPU) fits the
    memory ``device`` has free now; ``option`` (a settings key) is the setting blamed."""
    device = torch.device(device)
    need = cache_bytes(layout, num_blocks=num_blocks, num_rings=num_rings) * copies
    have = available_bytes(device)
    if have is not None and need > have:
        name = option.replace("_", "-")
        copies_text = f" x {copies} ranks" if copies > 1 else ""
        raise SettingsError(f"{name} {settings.get(option)} ({source_of(settings, option)}): a cache of {num_blocks} "
                            f"blocks of {layout.block_bytes} bytes and {num_rings} rings{copies_text} needs "
                            f"{need / GIB:.1f} GiB, and {device.type} has {have / GIB:.1f} GiB available")
