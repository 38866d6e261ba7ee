"""Pipeline benchmark: time to first token with whole and with chunked prefill, and how much of the
transfer is left exposed after the prompt's last chunk (``exposed_transfer_ms / transfer_ms``).

    python -m kpool_pd.bench.pipeline [--prompt-len 4096] [--max-batch-tokens 256] [--runs 3] [--device cpu|cuda]
                             [--transport ucx|grpc] [--layers 2] [--out DIR] [--no-timeline]

Figures: each run is ``kpool-pd up --json --requests 1`` as a user runs it (a prefill and a decode
daemon on loopback, checked against the colocated run), once with the whole prompt in one step
(``--max-batch-tokens`` = the prompt length) and once chunked (``--max-batch-tokens N``); the table
gives the medians over ``--runs`` runs of each. With ``--device cuda`` the daemons run on the GPU(s)
(``kpool-pd up --device cuda``: the prefill on cuda:0, the decode on cuda:1 when there are two).

Timeline: the same two prefills once more in this process (the prefill connector, its token-budget
engine and a decode connector on one event loop), recording when each step computed and when each
piece was being sent, drawn as a PNG when matplotlib imports (it is not a dependency of the project;
without it only the JSON is written). Writes pipeline-<date>-<machine>-<device>.json (and .png) under
--out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from kpool_pd.bench.arguments import bench_parser, count
from kpool_pd.bench.plotting import pyplot, wrote
from kpool_pd.connector import (ConnectorConfig, DecodeConnector, PrefillConnector, Transport, ucx_available)
from kpool_pd.kvcache import BlockLayout, NodeCache
from kpool_pd.model import Engine, ModelConfig
from kpool_pd.model.colocated import make_prompts
from kpool_pd.prefill_worker.batcher import BatchingPrefillEngine
from kpool_pd.runtime import GrpcServer

FIELDS = ("ttft_ms", "prefill_ms", "transfer_ms", "exposed_transfer_ms")


def up_run(args, budget: int) -> dict:
    """One ``kpool-pd up --json --requests 1`` run with the prefill daemon's token budget ``budget``."""
    command = [sys.executable, "-m", "kpool_pd", "up", "--json", "--requests", "1", "--max-tokens", "2",
               "--prompt-len", str(args.prompt_len), "--max-batch-tokens", str(budget), "--device", args.device,
               "--transport", args.transport, "--layers", str(args.layers)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[2:])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    row, summary = (json.loads(line) for line in proc.stdout.splitlines())
    return {**{f: row[f] for f in FIELDS}, "bytes": row["transfer_bytes"],
            "match": summary["summary"]["colocated_match"] == summary["summary"]["ok"] == 1}


def measure(args) -> list[dict]:
    rows = []
    for mode, budget in (("whole", args.prompt_len), ("chunked", args.max_batch_tokens)):
        runs = []
        for index in range(args.runs):
            sys.stderr.write(f"{mode} prefill (budget {budget}), run {index + 1}/{args.runs} ...\n")
            runs.append(up_run(args, budget))
        med = {f: statistics.median(r[f] for r in runs) for f in FIELDS}
        rows.append({"mode": mode, "max_batch_tokens": budget, **med, "bytes": runs[0]["bytes"],
                     "exposed_share": med["exposed_transfer_ms"] / med["transfer_ms"] if med["transfer_ms"] else 0.0,
                     "all_match": all(r["match"] for r in runs), "runs": runs})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'prefill':<8} {'budget':>6} {'ttft ms':>9} {'prefill ms':>10} {'transfer ms':>11} {'exposed ms':>10} "
            f"{'exposed/transfer':>16}  colocated")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['mode']:<8} {r['max_batch_tokens']:>6} {r['ttft_ms']:9.1f} {r['prefill_ms']:10.1f} "
                     f"{r['transfer_ms']:11.2f} {r['exposed_transfer_ms']:10.2f} {100 * r['exposed_share']:15.0f}%  "
                     f"{'match' if r['all_match'] else 'MISMATCH'}")
    return "\n".join(lines)


# the timeline ---------------------------------------------------------------------------------------
class TimedEngine(Engine):
    """The engine, keeping each step's (start, end) in perf_counter seconds."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[float, float]] = []

    def prefill(self, jobs):
        started = time.perf_counter()
        out = super().prefill(jobs)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.steps.append((started, time.perf_counter()))
        return out


async def timeline(config: ModelConfig, prompt: tuple[int, ...], budget: int, device: str, transport: Transport) -> dict:
    """One pipelined prefill and pull in this process: step and send intervals, in ms from the Prefill call."""
    layout = BlockLayout(config.cache)
    blocks = config.cache.blocks_for_tokens(len(prompt)) + 2
    transports = (transport,)
    cfg = ConnectorConfig(piece_tokens=budget, rpc_timeout_s=120, transfer_timeout_s=120)
    prefill_cache = NodeCache(layout, num_blocks=blocks, num_rings=2, device=device)
    engine = TimedEngine(config, prefill_cache.pool)
    batcher = BatchingPrefillEngine(engine, prefill_cache, max_batch_tokens=budget, max_queue=4,
                                    registry=CollectorRegistry())
    node = PrefillConnector(prefill_cache.pool, batcher, engine_id="bench-p",
                            config=cfg, registry=CollectorRegistry(), transports=transports)
    pulls = []
    node.on_pull_done = pulls.append
    await node.start()
    server = GrpcServer(options=cfg.grpc_options())
    server.add(node)
    await server.set_serving(True)
    port = await server.start("127.0.0.1", 0)
    steps = asyncio.create_task(batcher.run())
    decode_cache = NodeCache(layout, num_blocks=blocks, num_rings=2, device=device)
    decode = await DecodeConnector(decode_cache.pool, engine_id="bench-d", config=cfg,
                                   registry=CollectorRegistry(), transports=transports).start()
    try:
        peer = await decode.connect(f"127.0.0.1:{port}")
        for name, tokens in (("warm-up", prompt[:2 * budget + 1]), ("timed", prompt)):
            engine.steps.clear()
            t0 = time.perf_counter()
            grant = await peer.prefill(name, tokens, pipelined=True)
            with decode_cache.allocate(name, decode_cache.config.blocks_for_tokens(grant.prompt_len)) as allocation:
                landed = await peer.pull(grant, into=allocation, transport=transport, release=False)
                held = time.perf_counter()
                times = landed.times
            await peer.release(grant.grant_id)
        spans = pulls[-1].clock.spans
        ms = lambda t: (t - t0) * 1000  # noqa: E731
        return {"max_batch_tokens": budget, "steps_ms": [(ms(a), ms(b)) for a, b in engine.steps],
                "sends_ms": [(i, ms(a), ms(b)) for i, a, b in spans], "first_token_ms": ms(held),
                "prefill_ms": times.prefill_ms, "transfer_ms": times.transfer_ms,
                "exposed_transfer_ms": times.exposed_transfer_ms}
    finally:
        await decode.close()
        steps.cancel()
        await asyncio.gather(steps, return_exceptions=True)
        await server.stop(0)
        await node.stop()


def plot(lines: list[dict], path: Path, title: str) -> bool:
    """Draw the timelines; False (nothing written) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(len(lines), 1, figsize=(9, 1.9 * len(lines) + 0.6), sharex=True, squeeze=False)
    for ax, line in zip(axes[:, 0], lines):
        for k, (a, b) in enumerate(line["steps_ms"]):
            ax.barh(1, b - a, left=a, height=0.6, color=("tab:blue", "tab:cyan")[k % 2])
        for i, a, b in line["sends_ms"]:
            ax.barh(0, max(b - a, 0.05), left=a, height=0.6, color=("tab:orange", "tab:red")[i % 2])
        ax.axvline(line["first_token_ms"], color="black", linestyle="--", linewidth=1)
        last = max(b for _, b in line["steps_ms"])
        ax.axvline(last, color="tab:blue", linestyle=":", linewidth=1)
        ax.set_yticks([0, 1], ["transfer\n(pieces)", "prefill\n(steps)"])
        ax.set_title(f"budget {line['max_batch_tokens']} tokens: exposed {line['exposed_transfer_ms']:.1f} of "
                     f"{line['transfer_ms']:.1f} ms transfer; first token at {line['first_token_ms']:.0f} ms",
                     fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms from the Prefill call (dotted: last step ends; dashed: decode node holds every byte)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("kpool-pd bench pipeline", __doc__)
    parser.add_argument("--prompt-len", type=count, default=4096, help="prompt tokens of the one request (default 4096)")
    parser.add_argument("--max-batch-tokens", type=count, default=256, help="the chunked run's token budget")
    parser.add_argument("--runs", type=count, default=3, help="kpool-pd up runs of each prefill (medians shown)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the daemons run (kpool-pd up --device; default cpu)")
    transport = "ucx" if ucx_available() else "grpc"
    parser.add_argument("--transport", choices=["ucx", "grpc"], default=transport,
                        help=f"data plane between the daemons (default here: {transport})")
    parser.add_argument("--layers", type=count, default=2, help="model layers (default 2)")
    parser.add_argument("--no-timeline", action="store_true", help="skip the in-process timeline")
    parser.add_argument("--machine", default=platform.node() or "machine", help="name in the result file names")
    parser.add_argument("--out", type=Path, default=Path("bench/results"),
                        help="folder for the JSON and PNG results (default bench/results)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    rows = measure(args)
    sys.stdout.write(table(rows) + "\n")
    lines = []
    if not args.no_timeline:
        config = ModelConfig.build(num_layers=args.layers, num_spec=3)
        prompt = make_prompts(1, args.prompt_len, seed=0, vocab_size=config.vocab_size, max_tokens=2)[0].prompt
        device = "cuda:0" if args.device == "cuda" else "cpu"
        for budget in (args.prompt_len, args.max_batch_tokens):
            lines.append(asyncio.run(timeline(config, prompt, budget, device, Transport.parse(args.transport))))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"pipeline-{dt.date.today().isoformat()}-{args.machine}-{args.device}"
    meta = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": args.machine, "device": args.device,
            "transport": args.transport, "prompt_len": args.prompt_len, "layers": args.layers, "runs": args.runs,
            "command": f"kpool-pd up --prompt-len {args.prompt_len} --max-batch-tokens {args.max_batch_tokens} "
                       f"--requests 1 --max-tokens 2 --transport {args.transport} --device {args.device}"}
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows, "timelines": lines}, indent=1) + "\n")
    drawn = bool(lines) and plot(lines, args.out / f"{stem}.png",
                                 f"kpool-pd pipelined transfer, {args.prompt_len}-token prompt ({args.device}, "
                                 f"{args.transport})")
    sys.stdout.write(wrote(args.out / f"{stem}.json", drawn) + "\n")
    return 0 if all(r["all_match"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
