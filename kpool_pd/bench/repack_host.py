"""The host's time to enqueue the repack of a pull from a prefill node of another block size (what a pull from
128-token blocks spends between its last byte landed and its return, ``Landing.convert``), in parts: the public
op (``kernels.repack_tokens``: its checks, then its launches; warm, back to back, and cold, after the caches were
evicted and the thread slept, as a pull's repack comes after its wait on the receives), the launches alone
(``repack_tokens_triton``), the readiness event recorded behind them (``BlocksReady.behind_current_work``), and
the block table put on the device (``kernels.block_ids_on``, which ``Landing.prepare`` does while the bytes
travel); beside them the launches' time on the device (CUDA events), and the same launches one a field (a kpool
cache's three fields are otherwise one fused launch), their bytes checked equal first. The device is synchronised
between calls, outside the clock, so that no call waits on a full launch queue.

    python -m kpool_pd.bench.repack_host --tokens 1024,4096,32768 --reps 200     (CUDA)
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from kpool_pd.bench.arguments import bench_parser, count, counts
from kpool_pd.bench.repack_cases import LAYERS
from kpool_pd.connector import BlocksReady
from kpool_pd.kernels import block_ids_on, repack_tokens
from kpool_pd.kernels.token_repack.triton import repack_tokens_triton
from kpool_pd.kvcache import BlockLayout, CacheConfig

COLD_BYTES = 64 << 20  # host memory written before a cold call: more than the last-level cache of one core's complex
COLD_SLEEP_S = 0.002  # and the thread asleep that long, as a pull's thread waits on its receives before the repack


def _host_us(call, reps: int, device: torch.device, cold: bool = False) -> float:
    """Median host time of ``call()`` in microseconds, the device idle before each call (after 5 warm-ups);
    ``cold``: before each call (outside the clock) ``COLD_BYTES`` of host memory written and the thread asleep
    ``COLD_SLEEP_S``, so that the call finds the caches and the core as a pull's repack does after its wait."""
    times = []
    evict = torch.empty(COLD_BYTES, dtype=torch.uint8) if cold else None
    for rep in range(reps + 5):
        torch.cuda.synchronize(device)
        if evict is not None:
            evict.fill_(rep % 251)
            time.sleep(COLD_SLEEP_S)
        started = time.perf_counter()
        call()
        elapsed = time.perf_counter() - started
        if rep >= 5:
            times.append(elapsed * 1e6)
    torch.cuda.synchronize(device)
    return statistics.median(times)


def _device_us(call, reps: int, device: torch.device) -> float:
    """Median device time of ``call()``'s kernels in microseconds (CUDA events around it; after 5 warm-ups)."""
    times = []
    for rep in range(reps + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        if rep >= 5:
            times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def measure(tokens: int, reps: int, device: torch.device, src_block: int = 128, dst_block: int = 256) -> dict[str, float]:
    """Host microseconds of each part of one repack of ``tokens`` tokens from ``src_block``- into ``dst_block``-token
    blocks of a 61-layer kpool cache, block tables on the device as a pull has them."""
    src_layout = BlockLayout(CacheConfig(layer_names=LAYERS, block_size=src_block, kpool=4, num_spec=3))
    dst_layout = BlockLayout(CacheConfig(layer_names=LAYERS, block_size=dst_block, kpool=4, num_spec=3))
    src_n, dst_n = src_layout.config.blocks_for_tokens(tokens), dst_layout.config.blocks_for_tokens(tokens)
    src = torch.randint(0, 256, (src_n, src_layout.block_bytes), dtype=torch.uint8, device=device)
    dst = torch.zeros(dst_n + 2, dst_layout.block_bytes, dtype=torch.uint8, device=device)
    src_ids, dst_ids = torch.arange(src_n, device=device), torch.arange(2, dst_n + 2, device=device)
    launches = lambda: repack_tokens_triton(src, src_layout, src_ids, dst, dst_layout, dst_ids, tokens)  # noqa: E731
    per_field = lambda: repack_tokens_triton(src, src_layout, src_ids, dst, dst_layout, dst_ids, tokens,  # noqa: E731
                                             per_field=True)
    before = dst.clone()
    launches()
    fused = dst.clone()
    dst.copy_(before)
    per_field()
    if not torch.equal(fused, dst):
        raise SystemExit(f"{tokens} tokens: the fused launch's bytes differ from the per-field launches'")
    public_op = lambda: repack_tokens(src, src_layout, src_ids, dst, dst_layout, dst_ids, tokens)  # noqa: E731
    return {
        "public op": _host_us(public_op, reps, device),
        "public op, cold": _host_us(public_op, reps, device, cold=True),
        "launches": _host_us(launches, reps, device),
        "event": _host_us(lambda: BlocksReady.behind_current_work(device), reps, device),
        "block table": _host_us(lambda: block_ids_on(range(2, dst_n + 2), device), reps, device),
        "device": _device_us(launches, reps, device),
        "per-field launches": _host_us(per_field, reps, device),
        "per-field device": _device_us(per_field, reps, device),
    }


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("python -m kpool_pd.bench.repack_host", __doc__)
    parser.add_argument("--tokens", type=counts, default=[1024, 4096, 32768], help="request sizes (default 1024,4096,32768)")
    parser.add_argument("--reps", type=count, default=200, help="timed calls a part and size (default 200)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the repack runs its Triton kernels there)")
    device = torch.device("cuda:0")
    sys.stdout.write(f"{'tokens':>7} {'public op us':>13} {'cold op us':>11} {'launches us':>12} {'event us':>9} "
                     f"{'block table us':>15} {'device us':>10} {'per-field launches us':>22} "
                     f"{'per-field device us':>20}   (host time but the device columns, median of {args.reps}; "
                     f"cold: caches evicted and the thread asleep before each call; launches: as the op makes "
                     f"them; per-field: one a field; {torch.cuda.get_device_name(device)})\n")
    for tokens in args.tokens:
        parts = measure(tokens, args.reps, device)
        sys.stdout.write(f"{tokens:>7} {parts['public op']:>13.1f} {parts['public op, cold']:>11.1f} "
                         f"{parts['launches']:>12.1f} {parts['event']:>9.1f} "
                         f"{parts['block table']:>15.1f} {parts['device']:>10.1f} {parts['per-field launches']:>22.1f} "
                         f"{parts['per-field device']:>20.1f}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
