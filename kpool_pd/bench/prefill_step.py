"""The engine's prefill of one long prompt, whole and in chunks, in one process: per forward its wall
time, host time (less the waits in synchronisations), GPU busy time and kernel launches (torch's
profiler), and the prompt's time to its first token each way. It separates the engine's per-chunk cost
from the daemons' (``kpool-pd bench pipeline`` measures the whole path).

Three forwards, side by side on the same prompt: ``per-layer`` (every layer computes its own inputs, the
CPU's forward), ``hoisted`` (a CUDA engine's eager forward: inputs for many layers at once) and ``graphed``
(steps of exactly the chunk's tokens replayed from a CUDA graph, as the prefill daemon runs them; CUDA only).
The last lines give each forward's chunked time to first token over its whole one, and over the whole
prompt's hoisted forward.

    python -m kpool_pd.bench.prefill_step --device cuda --layers 61 --prompt-len 32768 --chunk 2048
"""

from __future__ import annotations

import logging
import time

import torch

from kpool_pd.bench.arguments import bench_parser, count
from kpool_pd.bench.decode_step import profiled, synchronize
from kpool_pd.kvcache import BlockLayout, CacheFamily, NodeCache
from kpool_pd.model import ModelConfig
from kpool_pd.model.engine import Engine, PrefillJob

logger = logging.getLogger("kpool_pd.bench.prefill_step")


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
    parser = bench_parser("python -m kpool_pd.bench.prefill_step", __doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=count, default=61, help="model layers (default 61)")
    parser.add_argument("--prompt-len", type=count, default=32768, help="prompt tokens (default 32768)")
    parser.add_argument("--chunk", type=count, default=2048, help="tokens a chunk (default 2048)")
    parser.add_argument("--kernels", type=int, default=0, metavar="N", help="also print the N kernels that take the "
                        "most GPU time in a chunk's forward, for each forward (default 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    config = ModelConfig.build(family=CacheFamily.KPOOL, num_layers=args.layers, num_spec=3)
    blocks = config.cache.blocks_for_tokens(args.prompt_len)
    cache = NodeCache(BlockLayout(config.cache), num_blocks=blocks, num_rings=1, device=device)
    per_layer = Engine(config, cache.pool)
    per_layer.hoists = False
    engines = {"per-layer": lambda chunk: per_layer}
    if device.type == "cuda":
        hoisted = Engine(config, cache.pool, weights=per_layer.weights)
        graphed = {size: Engine(config, cache.pool, weights=per_layer.weights, prefill_graph_tokens=size,
                                prefill_graph_requests=1, graph_table_width=blocks)
                   for size in {args.prompt_len, args.chunk}}
        engines |= {"hoisted": lambda chunk: hoisted, "graphed": lambda chunk: graphed[chunk]}
    prompt = torch.randint(0, config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(5)).tolist()
    print(f"{'forward':9} {'prefill':8} {'chunk':>6} {'ttft ms':>9} {'forwards':>8} {'ms a forward':>12} {'host ms':>8} "
          f"{'GPU ms':>8} {'launches':>8}")
    ttft: dict[tuple[str, int], float] = {}
    for name, engine_of in engines.items():
        for chunk in (args.prompt_len, args.chunk):
            engine = engine_of(chunk)
            prefill_once(engine, cache, prompt, chunk)  # warm-up: compiles the kernels, captures the graphs
            ttft_ms, jobs = prefill_once(engine, cache, prompt, chunk)
            ttft[name, chunk] = ttft_ms
            middle = jobs[len(jobs) // 2]
            with cache.allocate("profiled", len(jobs[0].block_ids)) as held:
                job = PrefillJob(prompt=prompt, block_ids=held.block_ids, ring_id=held.ring_id, start=middle.start,
                                 end=middle.end)
                step = profiled(lambda: engine.prefill([job]), 1, device)
            print(f"{name:9} {'whole' if chunk == args.prompt_len else 'chunked':8} {chunk:>6} {ttft_ms:>9.1f} "
                  f"{len(jobs):>8} {ttft_ms / len(jobs):>12.1f} {step.host_ms:>8.1f} {step.gpu_ms:>8.1f} "
                  f"{step.launches:>8.0f}")
            if args.kernels and chunk == args.chunk:
                print(step.kernel_table(args.kernels))
    whole = ttft.get(("hoisted", args.prompt_len), ttft["per-layer", args.prompt_len])
    for name in engines:
        chunked = ttft[name, args.chunk]
        print(f"{name}: chunked ({args.chunk}) {chunked:.1f} ms = {chunked / ttft[name, args.prompt_len]:.2f}x its "
              f"whole prompt, {chunked / whole:.2f}x the whole prompt's hoisted forward")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
