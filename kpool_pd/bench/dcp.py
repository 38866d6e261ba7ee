"""Decode-context-parallel benchmark: the decode step time of long contexts at DCP 1, 2, ...; each
rank's cache memory; and the bytes each rank receives in the transfer (DCP adds none but the ring).

    python -m kpool_pd.bench.dcp [--device cpu|cuda] [--ranks 1,2] [--tokens 32768] [--batch 4] [--out DIR]

For each rank count N, N processes (rank r on cuda:r with --device cuda, joined by NCCL; gloo on
the CPU) each prefill the batch on a whole-request pool (what a prefill node would send), land
their share into their own pool (``kpool_pd.model.dcp_landing``), free the whole pool, and time
``--steps`` decode steps of the batch together (the device synchronised around each; the median
is reported). The transfer's bytes per rank are ``kpool_pd.connector.shared.dcp_plan``'s plan for each rank
beside the single-rank plan. Prints a table; writes dcp-<date>-<machine>.json (and a PNG unless
--no-plot) under --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import tempfile
import time
import traceback
from multiprocessing.queues import Queue
from pathlib import Path

import torch

from kpool_pd.bench.arguments import bench_parser, count, counts
from kpool_pd.bench.plotting import pyplot, wrote
from kpool_pd.connector import dcp_transfer_bytes
from kpool_pd.kvcache import BlockLayout, DcpConfig, NodeCache
from kpool_pd.model import DecodeSequence, ModelConfig
from kpool_pd.model.colocated import make_prompts, prefill_batch
from kpool_pd.model.dcp_engine import DcpEngine
from kpool_pd.model.dcp_group import DcpGroup
from kpool_pd.model.dcp_landing import land_request
from kpool_pd.runtime.launch import child_context, start_child


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(args: dict) -> ModelConfig:
    """The bench's model, from its flags (ValueError for a combination the model refuses)."""
    return ModelConfig.build(kpool=args["kpool"], num_spec=args["num_spec"], num_layers=args["layers"],
                       block_size=args["block_size"])


def _rank_main(rank: int, size: int, args: dict, store: str, out: Queue) -> None:
    try:
        torch.set_num_threads(1)
        device = torch.device(f"cuda:{rank}" if args["device"] == "cuda" else "cpu")
        config = _model(args)
        dcp = DcpConfig.for_cache(config.cache, size=size)
        group = DcpGroup.join(dcp.shard(rank), init_method=f"file://{store}", device=device, timeout_s=600)
        max_tokens = (args["steps"] + args["warmup"]) * (config.cache.num_spec + 1) + 2
        requests = make_prompts(args["batch"], args["tokens"], seed=1, vocab_size=config.vocab_size,
                                max_tokens=max_tokens)
        full = prefill_batch(config, requests, device)
        need = dcp.rank_blocks_for_request(config.cache, args["tokens"], max_tokens)
        cache = NodeCache(config.cache, num_blocks=need * len(requests), num_rings=len(requests),
                          device=device)
        pool = cache.pool
        engine = DcpEngine(config, pool, group)
        seqs, allocations = [], [cache.allocate(r.request_id, need) for r in requests]
        for req, whole, mine, first in zip(requests, full.allocations, allocations, full.first_tokens):
            land_request(full.cache.pool, list(whole.block_ids), whole.ring_id, pool, list(mine.block_ids),
                         mine.ring_id, dcp.shard(rank), args["tokens"])
            seqs.append(DecodeSequence(request_id=req.request_id, prompt_len=args["tokens"], max_tokens=max_tokens,
                                       allocation=mine, output=[first]))
        full.release()
        del full
        if device.type == "cuda":
            torch.cuda.empty_cache()
        times = []
        for step in range(args["warmup"] + args["steps"]):
            group.barrier()
            _sync(device)
            started = time.perf_counter()
            engine.decode_step(seqs)
            _sync(device)
            if step >= args["warmup"]:
                times.append((time.perf_counter() - started) * 1000)
        shard = dcp.shard(rank)
        held = shard.blocks_for_tokens(config.cache, args["tokens"])
        layout = pool.layout
        out.put((rank, {"step_ms": times, "cache_bytes": held * layout.block_bytes + layout.ring_block_bytes,
                        "tokens": [s.output for s in seqs]}, None))
        for allocation in allocations:
            allocation.release()
        group.leave()
    except BaseException:
        out.put((rank, None, traceback.format_exc()))


def transfer_bytes(config: ModelConfig, size: int, tokens: int) -> list[int]:
    """What each of ``size`` ranks receives for one ``tokens``-token prompt (one rank: the whole plan)."""
    cache = config.cache
    return dcp_transfer_bytes(BlockLayout(cache), tokens, DcpConfig.for_cache(cache, size=size))


def run_one(size: int, args: dict) -> dict:
    out = child_context().Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [start_child(_rank_main, r, size, args, os.path.join(tmp, "store"), out, daemon=False)
                 for r in range(size)]
        reports = {}
        try:
            for _ in range(size):
                rank, report, error = out.get(timeout=args["timeout_s"])
                if error:
                    raise RuntimeError(f"rank {rank} of {size} failed:\n{error}")
                reports[rank] = report
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    config = _model(args)
    steps = [statistics.median(reports[r]["step_ms"]) for r in range(size)]
    return {"ranks": size, "step_ms_median": max(steps), "step_ms_by_rank": steps,
            "cache_bytes_by_rank": [reports[r]["cache_bytes"] for r in range(size)],
            "transfer_bytes_by_rank": transfer_bytes(config, size, args["tokens"]),
            "tokens_equal_rank0": all(reports[r]["tokens"] == reports[0]["tokens"] for r in range(size)),
            "output": reports[0]["tokens"]}


def _table(rows: list[dict], args: dict) -> str:
    lines = [f"DCP decode step, {args['batch']} requests of {args['tokens']} tokens, {args['layers']} layers, kpool "
             f"{args['kpool']}, {args['num_spec']} drafts, block {args['block_size']}, {args['device']}",
             f"{'ranks':>5} {'step ms':>9} {'cache MiB/rank':>15} {'transfer MiB/rank':>18} {'transfer MiB total':>19}"]
    for row in rows:
        lines.append(f"{row['ranks']:>5} {row['step_ms_median']:>9.2f} {max(row['cache_bytes_by_rank']) / 2**20:>15.2f} "
                     f"{max(row['transfer_bytes_by_rank']) / 2**20:>18.2f} "
                     f"{sum(row['transfer_bytes_by_rank']) / 2**20:>19.2f}")
    same = len({json.dumps(r["output"]) for r in rows}) == 1
    lines.append(f"outputs equal across rank counts: {same}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("kpool-pd bench dcp", __doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu (gloo) or cuda (rank r on cuda:r, NCCL) (default cpu)")
    parser.add_argument("--ranks", type=counts, default=[1, 2], help="rank counts to measure, comma-separated "
                                                                     "(default 1,2)")
    parser.add_argument("--tokens", type=count, default=32768, help="context (prompt) length of each request")
    parser.add_argument("--batch", type=count, default=4, help="requests decoded together")
    parser.add_argument("--layers", type=count, default=4, help="model layers (default 4)")
    parser.add_argument("--kpool", type=count, default=4, help="tokens per kpool pool (default 4)")
    parser.add_argument("--num-spec", type=int, default=3, help="draft tokens per decode step (default 3)")
    parser.add_argument("--block-size", type=count, default=256, help="tokens per block (default 256)")
    parser.add_argument("--steps", type=count, default=20, help="timed decode steps, the median reported (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps before them (default 3)")
    parser.add_argument("--timeout-s", type=float, default=1800.0,
                        help="deadline of one rank count's run, its processes included (default 1800)")
    parser.add_argument("--machine", default=platform.node() or "machine", help="name in the result file names")
    parser.add_argument("--no-plot", action="store_true", help="write the JSON only, no PNG")
    parser.add_argument("--out", type=Path, default=Path("bench/results"),
                        help="folder for the JSON and PNG results (default bench/results)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    if args["warmup"] < 0:
        parser.error(f"--warmup must be >= 0, got {args['warmup']}")
    try:  # a model or rank count that does not fit fails here, before any rank process starts
        config = _model(args)
        for size in args["ranks"]:
            DcpConfig.for_cache(config.cache, size=size)
    except ValueError as exc:
        parser.error(str(exc))
    if args["device"] == "cuda" and torch.cuda.device_count() < max(args["ranks"]):
        parser.error(f"--ranks {max(args['ranks'])} needs as many GPUs; this machine has {torch.cuda.device_count()}")
    rows = [run_one(size, args) for size in args["ranks"]]
    text = _table(rows, args)
    print(text)
    args["out"].mkdir(parents=True, exist_ok=True)
    stem = f"dcp-{dt.date.today().isoformat()}-{args['machine']}"
    (args["out"] / f"{stem}.json").write_text(json.dumps(
        {"args": {k: str(v) if isinstance(v, Path) else v for k, v in args.items()},
         "rows": [{k: v for k, v in r.items() if k != "output"} for r in rows]}, indent=1))
    plt = None if args["no_plot"] else pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.bar([str(r["ranks"]) for r in rows], [r["step_ms_median"] for r in rows])
        ax.set_xlabel("DCP ranks")
        ax.set_ylabel("decode step, ms (median)")
        ax.set_title(f"{args['batch']} x {args['tokens']} tokens, {args['device']}")
        fig.tight_layout()
        fig.savefig(args["out"] / f"{stem}.png")
        plt.close(fig)
    print(wrote(args["out"] / f"{stem}.json", plt is not None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
