"""The engine's prefill of one long prompt, whole and in chunks, in one process: per forward its wall
time, host time (less the waits in synchronisations), GPU busy time and kernel launches (torch's
profiler), and the prompt's time to its first token each way. It separates the engine's per-chunk cost
from the daemons' (``kpool-pd bench pipeline`` measures the whole path).

    python -m bench.prefill_step --device cuda --layers 61 --prompt-len 32768 --chunk 2048
"""

from __future__ import annotations

import logging
import time

import torch

from bench.arguments import bench_parser, count
from bench.decode_step import profiled, synchronize
from kvcache import BlockLayout, CacheFamily, NodeCache
from model import ModelConfig
from model.engine import Engine, PrefillJob

logger = logging.getLogger("bench.prefill_step")


def prefill_once(engine: Engine, cache: NodeCache, prompt: list[int], chunk: int) -> tuple[float, list[PrefillJob]]:
    """(ms to the first token, the chunks) of one prefill of ``prompt`` in chunks of ``chunk`` tokens."""
    config = engine.config.cache
    with cache.allocate("bench", config.blocks_for_tokens(len(prompt))) as held:
        jobs = [PrefillJob(prompt=prompt, block_ids=held.block_ids, ring_id=held.ring_id, start=start,
                           end=min(start + chunk, len(prompt))) for start in range(0, len(prompt), chunk)]
        synchronize(engine.device)
        began = time.perf_counter()
        for job in jobs:
            engine.prefill([job])
        synchronize(engine.device)
        return (time.perf_counter() - began) * 1000, jobs


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("python -m bench.prefill_step", __doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=count, default=61, help="model layers (default 61)")
    parser.add_argument("--prompt-len", type=count, default=32768, help="prompt tokens (default 32768)")
    parser.add_argument("--chunk", type=count, default=2048, help="tokens a chunk (default 2048)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    config = ModelConfig.build(family=CacheFamily.KPOOL, num_layers=args.layers, num_spec=3)
    cache = NodeCache(BlockLayout(config.cache), num_blocks=config.cache.blocks_for_tokens(args.prompt_len),
                      num_rings=1, device=device)
    engine = Engine(config, cache.pool)
    prompt = torch.randint(0, config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(5)).tolist()
    print(f"{'prefill':8} {'chunk':>6} {'ttft ms':>9} {'forwards':>8} {'ms a forward':>12} {'host ms':>8} {'GPU ms':>8} "
          f"{'launches':>8}")
    for chunk in (args.prompt_len, args.chunk):
        prefill_once(engine, cache, prompt, chunk)  # warm-up: compiles the kernels
        ttft_ms, jobs = prefill_once(engine, cache, prompt, chunk)
        with cache.allocate("profiled", len(jobs[0].block_ids)) as held:
            middle = jobs[len(jobs) // 2]
            job = PrefillJob(prompt=prompt, block_ids=held.block_ids, ring_id=held.ring_id, start=middle.start,
                             end=middle.end)
            host_ms, gpu_ms, launches, _ = profiled(lambda: engine.prefill([job]), 1, device)
        print(f"{'whole' if chunk == args.prompt_len else 'chunked':8} {chunk:>6} {ttft_ms:>9.1f} {len(jobs):>8} "
              f"{ttft_ms / len(jobs):>12.1f} {host_ms:>8.1f} {gpu_ms:>8.1f} {launches:>8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
