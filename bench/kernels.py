"""Kernel benchmark on a CUDA device: time per kernel (CUDA graph replay, median of many, L2 flushed
when the case's bytes would fit in it) and achieved bandwidth against this device's own copy
bandwidth, measured in the same run. Prints a table; writes JSON, the table and a PNG to --out.

    python bench/kernels.py --out bench-out        # or: kpool-pd bench kernels --out bench-out

To add a kernel, append a ``BenchCase`` to ``CASES``: ``make(device)`` allocates the inputs once and
returns the call to time and the bytes it must move (each input read once, each output written once).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.language as tl

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import kpool_decode_update, kpool_indexer_topk, kpool_prefill  # noqa: E402
from kernels.kpool_cache.triton import write_entries_triton  # noqa: E402
from kernels.kpool_compress.triton import compress_pools_triton  # noqa: E402
from kernels.kpool_decode.triton import decode_update_triton  # noqa: E402
from kernels.kpool_prefill.triton import prefill_compress_write_triton  # noqa: E402
from kvcache import PoolMode, tail_ring_size  # noqa: E402
from kernels import build_qsa_metadata, qsa_forward_update, repack_blocks  # noqa: E402
from kvcache import BlockLayout, BlockOrder, CacheConfig, CacheFamily, qsa_ring_capacity  # noqa: E402

D = 128
L2_BYTES = 50 * 2**20  # H200: 50 MiB; a case whose bytes fit in twice this is timed after an L2 flush


@dataclass(frozen=True)
class Prepared:
    run: Callable[[], None]
    bytes_moved: int
    calls_per_replay: int = 1  # several calls captured in one graph: time is reported per call


@dataclass(frozen=True)
class BenchCase:
    name: str
    size: str
    make: Callable[[torch.device], Prepared]
    target_us: float | None = None  # figure to reach: time at most this
    target_copy_fraction: float | None = None  # figure to reach: bandwidth at least this fraction of copy
    anchor: str = ""  # the reference implementation's figure on this device, for comparison


def _keys(tokens: int, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """# -> k, gate: [tokens, 128] bf16 (random, never zeros)"""
    k = torch.randn(tokens, D, generator=gen, device=device).to(torch.bfloat16)
    gate = (2 * torch.randn(tokens, D, generator=gen, device=device)).to(torch.bfloat16)
    return k, gate


def _pages(num_blocks: int, states: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """# -> indexer_q: [num_blocks, S, 128] fp8, indexer_scale: [num_blocks, S] fp32"""
    iq = torch.randn(num_blocks, states, D, device=device).to(torch.float8_e4m3fn)
    return iq, torch.rand(num_blocks, states, device=device) + 0.01


def _prefill_inputs(device: torch.device, requests: int, tokens_each: int, kpool: int, states: int):
    gen = torch.Generator(device=device).manual_seed(1)
    tokens = requests * tokens_each
    k, gate = _keys(tokens, device, gen)
    ape = torch.randn(kpool, D, generator=gen, device=device)
    qsl = torch.arange(0, tokens + 1, tokens_each, dtype=torch.int32, device=device)
    block_size = kpool * states
    blocks_each = -(-tokens_each // block_size)
    table = torch.randperm(requests * blocks_each, generator=gen, device=device).view(requests, blocks_each)
    iq, iscale = _pages(requests * blocks_each, states, device)
    return k, gate, ape, qsl, table.to(torch.int32), iq, iscale


def make_prefill(requests: int = 256, tokens_each: int = 4096, kpool: int = 4, states: int = 64,
                 block_p: int | None = None, num_warps: int = 4, public: bool = True):
    """Prefill of one layer: compress + paged write of every pool (+ ring seeding through the public op)."""
    def make(device: torch.device) -> Prepared:
        k, gate, ape, qsl, table, iq, iscale = _prefill_inputs(device, requests, tokens_each, kpool, states)
        ring = torch.empty(requests, 2, tail_ring_size(kpool, 3), D, dtype=torch.bfloat16, device=device)
        ring_ids = torch.arange(requests, device=device)
        pools = requests * (tokens_each // kpool)
        moved = k.numel() * 2 * 2 + pools * (D + 4)
        if public:
            return Prepared(lambda: kpool_prefill(k, gate, ape, qsl, table, ring_ids, iq, iscale, ring), moved)
        return Prepared(lambda: prefill_compress_write_triton(
            k, gate, ape, qsl, table, iq, iscale, mode=PoolMode.SOFTMAX, round_scale=True, block_p=block_p,
            num_warps=num_warps), moved)
    return make


def make_decode(batch: int, tokens_each: int = 4, kpool: int = 4, states: int = 64, calls: int = 1,
                block_c: int | None = None, num_warps: int | None = None):
    """Decode step of one layer: every request stashes its tokens and compresses the pools they complete."""
    def make(device: torch.device) -> Prepared:
        gen = torch.Generator(device="cpu").manual_seed(2)
        ring_size = tail_ring_size(kpool, tokens_each - 1)
        start = torch.randint(64, 16_384, (batch,), generator=gen)
        blocks_each = (16_384 + tokens_each) // (kpool * states) + 1
        table = torch.randperm(batch * blocks_each, generator=gen).view(batch, blocks_each).to(torch.int32)
        iq, iscale = _pages(batch * blocks_each, states, device)
        k, gate = _keys(batch * tokens_each, device, torch.Generator(device=device).manual_seed(3))
        ring = torch.randn(batch, 2, ring_size, D, device=device).to(torch.bfloat16)
        ape = torch.randn(kpool, D, device=device)
        qsl = torch.arange(0, batch * tokens_each + 1, tokens_each, dtype=torch.int32, device=device)
        ring_ids = torch.randperm(batch, generator=gen).to(device)
        completed = int(((start + tokens_each) // kpool - start // kpool).sum())
        old_slots = int(torch.where((start + tokens_each) // kpool > start // kpool, start % kpool, 0).sum())
        moved = k.numel() * 2 * 2 * 2 + old_slots * 2 * D * 2 + completed * (D + 4)  # read + ring write
        args = (k, gate, start.to(device), qsl, ring_ids, table.to(device), ape, ring, iq, iscale)

        def run() -> None:
            for _ in range(calls):
                if num_warps is None:
                    kpool_decode_update(*args)
                else:  # a launch variant: the kernel alone
                    decode_update_triton(*args, mode=PoolMode.SOFTMAX, round_scale=True, block_c=block_c,
                                         num_warps=num_warps)
        return Prepared(run, moved * calls, calls)
    return make


def make_compress(pools: int = 262_144, kpool: int = 4):
    def make(device: torch.device) -> Prepared:
        gen = torch.Generator(device=device).manual_seed(4)
        k, gate = _keys(pools * kpool, device, gen)
        ape = torch.randn(kpool, D, generator=gen, device=device)
        k, gate = k.view(pools, kpool, D), gate.view(pools, kpool, D)
        run = lambda: compress_pools_triton(k, gate, ape, mode=PoolMode.SOFTMAX, round_scale=True)  # noqa: E731
        return Prepared(run, k.numel() * 2 * 2 + pools * (D + 4))
    return make


def make_write(entries: int = 262_144, states: int = 64):
    def make(device: torch.device) -> Prepared:
        gen = torch.Generator(device=device).manual_seed(5)
        iq, iscale = _pages(entries // states * 2, states, device)
        q = torch.randint(0, 256, (entries, D), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        scale = torch.rand(entries, device=device)
        slots = torch.randperm(iq.shape[0] * states, generator=gen, device=device)[:entries]
        # the kernel alone: the public op checks the slot range on the host, which a graph cannot capture
        return Prepared(lambda: write_entries_triton(iq, iscale, q, scale, slots), 2 * entries * (D + 4))
    return make


def make_score(batch: int = 64, seq_len: int = 16_384, heads: int = 64, kpool: int = 4, states: int = 64,
               topk: int = 2048):
    def make(device: torch.device) -> Prepared:
        gen = torch.Generator(device=device).manual_seed(6)
        blocks_each = seq_len // (kpool * states)
        iq, iscale = _pages(batch * blocks_each, states, device)
        table = torch.randperm(batch * blocks_each, generator=gen, device=device).view(batch, blocks_each)
        q = torch.randn(batch, heads, D, generator=gen, device=device).to(torch.bfloat16)
        w = torch.randn(batch, heads, generator=gen, device=device)
        seq_lens = torch.full((batch,), seq_len, device=device)
        pools = seq_len // kpool
        moved = batch * pools * (D + 4) + q.numel() * 2 + batch * pools * 4 + batch * topk * 12
        return Prepared(lambda: kpool_indexer_topk(q, w, seq_lens, table.to(torch.int32), iq, iscale, kpool=kpool,
                                                   topk=topk), moved)
    return make


def _qsa_batch(device: torch.device, requests: int, q_len: int, context: int, r: int, block_size: int):
    """A batch of `requests` chunks of `q_len` tokens ending at random lengths up to `context` (+ q_len)."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    seq = torch.randint(0, context, (requests,), generator=gen) + q_len
    cols = -(-(context + q_len) // block_size)
    table = torch.randperm(requests * cols, generator=gen).view(requests, cols)
    qsl = torch.arange(0, requests * q_len + 1, q_len)
    rings = torch.randperm(requests, generator=gen)
    return [t.to(torch.int32).to(device) for t in (qsl, seq, table, rings)]


def make_qsa_metadata(requests: int = 256, tokens: int = 8192, r: int = 4, num_spec: int = 3, block_size: int = 64):
    """QSA metadata builder: every output of one forward from the batch's offsets, lengths and tables."""
    def make(device: torch.device) -> Prepared:
        qsl, seq, table, rings = _qsa_batch(device, requests, tokens // requests, 16_384, r, block_size)
        cap = qsa_ring_capacity(r, num_spec)
        outputs = tokens * (4 + 8 + 4 + 8 + 8) + ((tokens + (r - 1) * requests) // r) * 8 + 4
        moved = (qsl.numel() + seq.numel() + rings.numel()) * 4 + tokens // r * 4 + outputs
        return Prepared(lambda: build_qsa_metadata(qsl, seq, table, rings, compress_ratio=r, ring_capacity=cap,
                                                   block_size=block_size, num_tokens=tokens), moved)
    return make


def make_qsa_update(requests: int = 64, q_len: int = 4096, r: int = 4, heads: int = 1, num_spec: int = 3,
                    block_size: int = 64, fp8: bool = False):
    """QSA forward update of one layer for a prefill batch: compress + write every completed group, then the
    ring rows (keys and packed positions) of each request's last C tokens."""
    def make(device: torch.device) -> Prepared:
        qsl, seq, table, rings = _qsa_batch(device, requests, q_len, 2 * block_size, r, block_size)
        cap = qsa_ring_capacity(r, num_spec)
        tokens = requests * q_len
        gen = torch.Generator(device=device).manual_seed(8)
        meta = build_qsa_metadata(qsl, seq, table, rings, compress_ratio=r, ring_capacity=cap,
                                  block_size=block_size, num_tokens=tokens)
        keys = torch.randn(tokens, heads, D, generator=gen, device=device).to(torch.bfloat16)
        positions = torch.randint(0, 1 << 20, (tokens, 3), generator=gen, device=device)
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        compressed = torch.zeros(table.numel(), block_size // r, heads, D, dtype=dtype, device=device)
        ring = torch.zeros(requests, cap, heads, D + 12, dtype=torch.bfloat16, device=device)
        weight = torch.randn(D, generator=gen, device=device)
        groups = int(meta.num_work)
        moved = keys.numel() * 2 + positions.numel() * 8 + groups * heads * D * compressed.element_size() + \
            requests * cap * (heads * (D + 12) * 2 + D * heads * 2 + 24)
        return Prepared(lambda: qsa_forward_update(
            keys, positions, meta, ring, compressed, weight, compress_ratio=r, block_size=block_size, eps=1e-6,
            rotary_dim=64, theta=10000.0, section=(12, 10, 10), cache_rope_positions=True), moved)
    return make


def make_repack(blocks: int = 512, layers: int = 16, block_size: int = 64, heads: int = 8, mla_heads: int = 1):
    """Block repack BLNHC -> BLHNC of a QSA pool: per layer an MLA page (656 B a token and head) and a
    compressed-key page of `heads` bf16 heads, transposed; bytes read + written against the device copy."""
    def make(device: torch.device) -> Prepared:
        config = CacheConfig(family=CacheFamily.QSA, layer_names=tuple(f"l{i}" for i in range(layers)),
                             block_size=block_size, mla_num_heads=mla_heads, qsa_num_heads=heads,
                             order=BlockOrder.BLNHC)
        src_layout = BlockLayout(config)
        dst_layout = BlockLayout(replace(config, order=BlockOrder.BLHNC))
        src = torch.randint(0, 256, (blocks, src_layout.block_bytes), dtype=torch.uint8, device=device)
        dst = torch.zeros(blocks, dst_layout.block_bytes, dtype=torch.uint8, device=device)
        gen = torch.Generator(device="cpu").manual_seed(9)
        src_ids = torch.randperm(blocks, generator=gen).to(device)
        dst_ids = torch.randperm(blocks, generator=gen).to(device)
        pages = layers * (src_layout.mla_page_bytes + src_layout.indexer_page_bytes)
        return Prepared(lambda: repack_blocks(src, src_layout, src_ids, dst, dst_layout, dst_ids),
                        2 * blocks * pages)
    return make


CASES: list[BenchCase] = [
    BenchCase("prefill compress+write+seed (public op)", "1 layer, 256 x 4096 tokens = 262,144 pools of 4",
              make_prefill(), target_copy_fraction=0.60, anchor="vLLM 362 us, 1.58 TB/s, 37% of copy"),
    *[BenchCase(f"prefill compress+write BLOCK_P={bp} warps={nw}", "262,144 pools of 4",
                make_prefill(block_p=bp, num_warps=nw, public=False), target_copy_fraction=0.60)
      for bp, nw in ((4, 4), (8, 4), (8, 2), (16, 4), (16, 8), (32, 4))],
    BenchCase("decode update, 3 drafts", "1 layer, batch 256 x 4 tokens", make_decode(256), target_us=5.0,
              anchor="vLLM 5.1 us a replay"),
    BenchCase("decode update, 3 drafts, 32 calls a graph", "batch 256 x 4 tokens, per call", make_decode(256, calls=32),
              anchor="vLLM 3.0 us a call"),
    BenchCase("decode update, 3 drafts", "1 layer, batch 1024 x 4 tokens", make_decode(1024), target_us=6.3),
    *[BenchCase(f"decode update, 3 drafts, BLOCK_C={bc} warps={nw}", f"batch {b} x 4 tokens",
                make_decode(b, block_c=bc, num_warps=nw)) for b in (256, 1024) for bc, nw in ((1, 1), (1, 2), (2, 2), (1, 4))],
    BenchCase("compress (standalone op)", "262,144 pools of 4", make_compress()),
    BenchCase("paged write of entries", "262,144 entries", make_write()),
    BenchCase("indexer scores + top-2048", "64 requests x 16k tokens, 64 heads", make_score()),
    BenchCase("qsa metadata builder", "8,192 tokens in 256 requests, r 4, C 8", make_qsa_metadata(), target_us=10.0),
    BenchCase("qsa forward update (prefill), bf16", "1 layer, 64 x 4096 tokens, r 4, 1 head",
              make_qsa_update()),
    BenchCase("qsa forward update (prefill), fp8, 4 heads", "1 layer, 16 x 4096 tokens, r 4, 4 heads",
              make_qsa_update(requests=16, heads=4, fp8=True)),
    BenchCase("qsa forward update (decode), 3 drafts", "1 layer, batch 256 x 4 tokens", make_qsa_update(
        requests=256, q_len=4), target_us=10.0),
    BenchCase("qsa block repack BLNHC->BLHNC", "512 blocks x 16 layers (MLA 1 head, keys 8 heads)", make_repack()),
    BenchCase("qsa block repack BLNHC->BLHNC, MLA 16 heads", "256 blocks x 16 layers", make_repack(
        blocks=256, mla_heads=16)),
]


def _capture(run: Callable[[], None]) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the capture
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    torch.cuda.synchronize()
    return graph


def time_graph(run: Callable[[], None], *, flush: torch.Tensor | None, reps: int) -> float:
    """Median microseconds of one graph replay, timed with CUDA events (the L2 flush stays outside)."""
    graph = _capture(run)
    for _ in range(5):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


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


def run_cases(cases: list[BenchCase], device: torch.device, copy_bps: float, reps: int) -> list[dict]:
    flush = torch.empty(4 * L2_BYTES, dtype=torch.uint8, device=device)
    rows = []
    for case in cases:
        try:
            prepared = case.make(device)
            small = prepared.bytes_moved < 2 * L2_BYTES * prepared.calls_per_replay
            replay_us = time_graph(prepared.run, flush=flush if small else None, reps=reps)
        except Exception as error:  # one failing case must not hide the others' figures
            print(f"{case.name}: failed: {error!r}", file=sys.stderr)
            rows.append({"kernel": case.name, "size": case.size, "time_us": float("nan"), "bytes": 0,
                         "bandwidth_GBps": float("nan"), "fraction_of_copy": float("nan"), "l2_flushed": False,
                         "target": _target_text(case), "met": False, "anchor": case.anchor, "error": repr(error)})
            continue
        us = replay_us / prepared.calls_per_replay
        bps = prepared.bytes_moved / prepared.calls_per_replay / (us * 1e-6)
        met = None
        if case.target_us is not None:
            met = us <= case.target_us
        elif case.target_copy_fraction is not None:
            met = bps / copy_bps >= case.target_copy_fraction
        rows.append({
            "kernel": case.name, "size": case.size, "time_us": round(us, 3), "bytes": prepared.bytes_moved //
            prepared.calls_per_replay, "bandwidth_GBps": round(bps / 1e9, 1), "fraction_of_copy": round(bps / copy_bps, 3),
            "l2_flushed": small, "target": _target_text(case), "met": met, "anchor": case.anchor,
        })
        del prepared
        torch.cuda.empty_cache()
    return rows


def _target_text(case: BenchCase) -> str:
    if case.target_us is not None:
        return f"<= {case.target_us} us"
    if case.target_copy_fraction is not None:
        return f">= {case.target_copy_fraction:.0%} of copy"
    return ""


def format_table(rows: list[dict], copy_bps: float, device_name: str) -> str:
    lines = [f"device: {device_name}; copy bandwidth (read + write): {copy_bps / 1e12:.2f} TB/s",
             f"{'kernel':<46} {'size':<46} {'time us':>9} {'GB/s':>8} {'% copy':>7} {'target':<18} {'met':<4} anchor"]
    for r in rows:
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        lines.append(f"{r['kernel']:<46} {r['size']:<46} {r['time_us']:>9.2f} {r['bandwidth_GBps']:>8.0f} "
                     f"{100 * r['fraction_of_copy']:>6.1f}% {r['target']:<18} {met:<4} {r['anchor']}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 0.45 * len(rows) + 2))
    names = [r["kernel"] for r in rows][::-1]
    left.barh(names, [r["time_us"] for r in rows][::-1], color="tab:blue")
    left.set_xscale("log")
    left.set_xlabel("time per call, us (log)")
    right.barh(names, [100 * r["fraction_of_copy"] for r in rows][::-1], color="tab:green")
    right.axvline(100, color="black", linewidth=1)
    right.set_xlabel("achieved bandwidth, % of device copy")
    right.set_yticks([])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kpool-pd bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for kernels.json/.txt/.png")
    parser.add_argument("--reps", type=int, default=200, help="timed graph replays per kernel (median reported)")
    parser.add_argument("--only", default="", help="run only the cases whose name contains one of these comma-separated texts")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA device (none found)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    device_name = torch.cuda.get_device_name(device)
    copies = copy_bandwidths(device)
    copy_name, copy_bps = max(copies.items(), key=lambda item: item[1])
    wanted = [part for part in args.only.split(",") if part] or [""]
    cases = [c for c in CASES if any(part in c.name for part in wanted)]
    rows = run_cases(cases, device, copy_bps, args.reps)
    table = format_table(rows, copy_bps, device_name)
    table += "\ncopy baselines (read + write): " + ", ".join(f"{name} {bps / 1e12:.2f} TB/s" for name, bps in copies.items())
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    (args.out / "kernels.json").write_text(json.dumps({
        "date": stamp, "device": device_name, "torch": torch.__version__, "triton": triton.__version__,
        "copy_bandwidth_GBps": round(copy_bps / 1e9, 1), "copy_method": copy_name,
        "copy_bandwidths_GBps": {name: round(bps / 1e9, 1) for name, bps in copies.items()}, "reps": args.reps, "rows": rows,
    }, indent=1))
    (args.out / "kernels.txt").write_text(table + "\n")
    plot(rows, args.out / "kernels.png", f"kpool kernels on {device_name}, {stamp} (copy {copy_bps / 1e12:.2f} TB/s)")
    print(table)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
