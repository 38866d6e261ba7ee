"""Regions of a plan as tensor views of a CachePool, and how each transport reads and writes them."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch

from kpool_pd.connector.shared.plan import PoolKind, Region
from kpool_pd.kvcache import CachePool


def region_view(pool: CachePool, region: Region, *, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [nbytes], aliasing the pool (no copy). IndexError-free: ValueError if out of range.
    ``blocks`` (uint8 [n, block_bytes], contiguous) stands in for the pool's block buffer: a
    staging buffer that block regions land in."""
    if region.kind is PoolKind.BLOCKS:
        flat = pool.block_plane(region.plane) if blocks is None else blocks.view(-1)
    else:
        flat = pool.rings.view(-1)
    if region.offset < 0 or region.offset + region.nbytes > flat.numel():
        raise ValueError(f"region {region} outside the {region.kind.name.lower()} pool of {flat.numel()} bytes")
    return flat[region.offset:region.offset + region.nbytes]


def ucx_buffer(view: torch.Tensor):
    """What ucxx sends from / receives into: a numpy view of host memory, the tensor itself on
    CUDA (``__cuda_array_interface__``). Never a copy."""
    return view.numpy() if view.device.type == "cpu" else view


def host_bytes(view: torch.Tensor) -> np.ndarray:
    """uint8 [n] host memory holding the view's bytes, for the gRPC stream: the view itself on the
    CPU (no copy), else a pinned host copy (synchronous). Read it before the view changes."""
    if view.device.type == "cpu":
        return view.numpy()
    host = torch.empty(view.numel(), dtype=torch.uint8, pin_memory=True)
    host.copy_(view)
    return host.numpy()


def write_bytes(view: torch.Tensor, data) -> None:
    """Write ``data`` (any buffer of len(view) bytes) into ``view`` (uint8 [n]). Into GPU memory the
    copy is asynchronous (from a pinned host buffer, on the view's device's current stream):
    ``settle`` before reading."""
    src = np.frombuffer(data, dtype=np.uint8)
    if view.device.type == "cpu":
        view.numpy()[:] = src
        return
    host = torch.empty(len(src), dtype=torch.uint8, pin_memory=True)
    host.numpy()[:] = src
    with torch.cuda.device(view.device):
        view.copy_(host, non_blocking=True)  # the host allocator keeps ``host`` until the copy ran


def settle(views: list[torch.Tensor]) -> None:
    """Wait until every ``write_bytes`` into these views has landed."""
    for device in {v.device for v in views if v.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


def crc32(view: torch.Tensor) -> int:
    """crc32 of the view's bytes (GPU memory is read through host)."""
    host = view if view.device.type == "cpu" else view.cpu()
    return zlib.crc32(memoryview(host.numpy())) & 0xFFFFFFFF


def back_to_back_crc32s(span: torch.Tensor, sizes: Sequence[int]) -> list[int]:
    """crc32 of each of the regions of ``sizes`` bytes laid back to back from the start of ``span`` (uint8); a
    span in GPU memory is read through host once, not once a region."""
    host = span[:sum(sizes)]
    host = host if host.device.type == "cpu" else host.cpu()
    checksums, at = [], 0
    for nbytes in sizes:
        checksums.append(crc32(host[at:at + nbytes]))
        at += nbytes
    return checksums
