"""The device's own copy bandwidth, the yardstick of the kernel bench, measured three ways."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from kpool_pd.bench.timing import time_graph


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    # int32 words, 4 per thread and access (16-byte loads and stores)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask, eviction_policy="evict_first"), mask=mask)


def _cudart_memcpy_async():
    """cudaMemcpyAsync from the CUDA runtime library that torch loaded (ctypes)."""
    import glob

    names = [path for folder in sys.path for path in glob.glob(f"{folder}/nvidia/cu*/lib/libcudart.so*")]
    names += glob.glob(f"{Path(torch.__file__).parent}/lib/libcudart*.so*") + ["libcudart.so", "libcudart.so.13",
                                                                            "libcudart.so.12"]
    for name in names:
        try:
            return ctypes.CDLL(name).cudaMemcpyAsync
        except OSError:
            continue
    raise RuntimeError("no libcudart found")


def copy_bandwidths(device: torch.device, nbytes: int = 2**30, reps: int = 30) -> dict[str, float]:
    """Device copy bandwidth in bytes/s (bytes read plus bytes written) by three means, each timed the same
    way (graph replay, median): torch copy_ of the buffer viewed as int64, a vectorised Triton copy kernel
    (16-byte accesses, 8,192 words a program), and cudaMemcpyAsync device to device."""
    src = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    words = src.numel()
    memcpy_async = _cudart_memcpy_async()

    def memcpy() -> None:
        code = memcpy_async(ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(src.data_ptr()), ctypes.c_size_t(nbytes),
                            3, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))  # 3: device to device
        if code != 0:
            raise RuntimeError(f"cudaMemcpyAsync returned {code}")

    block = 8192
    ways = {
        "torch copy_ (int64 view)": lambda: dst.view(torch.int64).copy_(src.view(torch.int64)),
        "triton vectorised copy": lambda: _copy_kernel[(triton.cdiv(words, block),)](src, dst, words, BLOCK=block,
                                                                                      num_warps=8),
        "cudaMemcpyAsync D2D": memcpy,
    }
    found = {}
    for name, run in ways.items():
        try:
            found[name] = 2 * nbytes / (time_graph(run, flush=None, reps=reps) * 1e-6)
        except Exception as error:  # one way failing leaves the others
            print(f"copy baseline {name}: failed: {error!r}", file=sys.stderr)
    return found
