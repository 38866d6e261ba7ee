"""Transfer benchmark: time from Pull to the last byte landed, per transport and request size,
beside baselines measured in the same run (memcpy of the same bytes; a raw loopback TCP stream
between two processes; a raw gRPC stream between two processes (``kpool_pd.bench.grpc_baseline``); torch's
peer copy when two GPUs are used; a raw ucxx tag send of the same bytes between two processes, with the
connector's UCX options and placement, where ucxx imports (``kpool_pd.bench.ucxx_baseline``: over a listener's
connection, the ratio's baseline, and over the connector's kind of endpoint); NIXL READ of the same bytes
across two processes where the nixl package imports).

    python -m kpool_pd.bench.transfer [--device cpu|cuda] [--two-gpu] [--tokens 1024,4096,...] [--out DIR]

Each UCX configuration runs with fresh processes (UCX reads its options once per process): the decode
node in one child process, the prefill node in another (``kpool_pd.runtime.launch``); with --prefill-block-size a
second prefill node of that block size, whose pulls alternate with the first one's in the same decode process.
The baselines live in ``kpool_pd.bench.transfer_baselines``. On the CPU
machine both same-host UCX configurations are measured (see ConnectorConfig.ucx_options).
Prints a table, writes transfer-<date>-<machine>.json (and a .png when matplotlib imports) under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from kpool_pd.bench.arguments import bench_parser, count, counts
from kpool_pd.bench.grpc_baseline import grpc_stream_gbps
from kpool_pd.bench.plotting import pyplot, wrote
from kpool_pd.bench.pull_hops import hop_lines, hop_offsets
from kpool_pd.bench.transfer_baselines import copy_gbps, import_nixl, nixl_read_gbps, socket_stream_gbps
from kpool_pd.bench.ucxx_baseline import UcxxEndpoint, ucxx_tag_gbps
from kpool_pd.connector import (UCX_NO_SHARED_MEMORY, HopRecorder, StepCountingLoop, UCX_SAME_HOST_ZERO_COPY, ConnectorConfig, DecodeConnector,
                       LandedRequest, PrefillConnector, PrefillInput, PrefillOutput, PrefillPeer, PrefillProgress,
                       PullTimeline, Transport, ucx_available)
from kpool_pd.kvcache import BlockLayout, CacheConfig, NodeCache
from kpool_pd.runtime import GrpcServer
from kpool_pd.runtime.launch import child_context, start_child


PHASES = tuple(f.name.removesuffix("_ms") for f in dataclasses.fields(PullTimeline))  # post, wire, completion, verify


def _config(layers: int, block_size: int, kpool: int) -> CacheConfig:
    return CacheConfig(layer_names=tuple(f"layer.{i}" for i in range(layers)), block_size=block_size, kpool=kpool, num_spec=3)


class _TemplateEngine:
    """Fills a request's blocks, allocated from its node cache, from a random template (the fill is not timed)."""

    def __init__(self, cache: NodeCache, template: torch.Tensor) -> None:
        self.cache, self.template = cache, template

    async def prefill(self, request: PrefillInput, progress: PrefillProgress) -> PrefillOutput:
        n = len(request.prompt_token_ids)
        allocation = self.cache.allocate(request.request_id, self.cache.config.blocks_for_tokens(n))
        progress.serve_from(allocation)
        pool = self.cache.pool
        pool.blocks[list(allocation.block_ids)] = self.template[: allocation.num_blocks]
        if pool.device.type == "cuda":  # the bytes must be written before UCX reads them
            torch.cuda.synchronize(pool.device)
        return PrefillOutput(prompt_len=n, first_token=0)


def _prefill_proc(conn, args: dict) -> None:
    recorder = HopRecorder().install() if args["hops"] else None

    async def main():
        config = _config(args["layers"], args["block_size"], args["kpool"])
        layout = BlockLayout(config)
        device = args["prefill_device"]
        cache = NodeCache(layout, num_blocks=args["num_blocks"], num_rings=4, device=device)
        template = torch.randint(0, 256, (args["num_blocks"], layout.block_bytes), dtype=torch.uint8, device=device)
        transports = (Transport.UCX, Transport.GRPC_STREAM) if args["ucx"] else (Transport.GRPC_STREAM,)
        config = ConnectorConfig(transfer_timeout_s=120, rpc_timeout_s=120, ucx_options=tuple(args["ucx_options"]))
        node = PrefillConnector(cache.pool, _TemplateEngine(cache, template),
                                engine_id="bench-prefill", config=config,
                                registry=CollectorRegistry(), transports=transports)
        await node.start()  # UCX first, then the server's threads (see runtime.daemon.serve)
        server = GrpcServer(options=config.grpc_options())
        server.add(node)
        await server.set_serving(True)
        conn.send(await server.start("127.0.0.1", 0))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)
        # the pulls are over; the node's stop may take long
        conn.send((recorder.stamps, recorder.steps) if recorder else ({}, {}))
        await server.stop(0)
        await node.stop()
    with asyncio.Runner(loop_factory=StepCountingLoop if recorder else None) as runner:  # --hops: count loop steps
        runner.run(main())
    os._exit(0)


# the connector --------------------------------------------------------------------------------
@dataclasses.dataclass
class _Series:
    """The pulls of one row: from one prefill node, over one transport, of one request size."""
    path: str
    peer: PrefillPeer  # the decode node's peer of that prefill node
    transport: Transport
    times: list[float] = dataclasses.field(default_factory=list)
    timelines: list[PullTimeline] = dataclasses.field(default_factory=list)
    starts: dict[str, float] = dataclasses.field(default_factory=dict)  # grant id -> when its timed pull began
    landed: LandedRequest | None = None  # the last pull's
    push: bool = False  # PrefillPush: the time is what the transfer exposes after the prompt


def _start_prefill(args: dict, ucx_options: tuple, block_size: int, transports: tuple[Transport, ...]):
    """A prefill process of ``block_size``-token blocks; (its process, its pipe, its gRPC port)."""
    blocks = _config(1, block_size, args["kpool"]).blocks_for_tokens(max(args["tokens"])) + 2
    conn, child = child_context().Pipe()
    proc = start_child(_prefill_proc, child, dict(
        layers=args["layers"], block_size=block_size, kpool=args["kpool"], num_blocks=blocks,
        ucx=Transport.UCX in transports, prefill_device=args["prefill_device"], ucx_options=ucx_options,
        hops=args["hops"]))
    return proc, conn, conn.recv()


async def _push_once(series: _Series, cache: NodeCache, tokens: int, rep: int) -> None:
    """One push of ``tokens`` tokens (PrefillPush): its time is what it exposes after the prompt was computed,
    from the grant stating it (or its PrefillDone) to the last byte landed (``TransferTimes``)."""
    request_id = f"t{tokens}-{series.path}-{rep}"
    with cache.allocate(request_id, cache.config.blocks_for_tokens(tokens)) as allocation:
        t0 = time.perf_counter()
        landed = await series.peer.push(request_id, [1] * tokens, into=allocation, transport=series.transport)
        if cache.pool.device.type == "cuda":
            torch.cuda.synchronize(cache.pool.device)
        if rep:
            series.starts[landed.grant.grant_id] = t0
            series.times.append(landed.times.exposed_transfer_ms / 1000)
            series.timelines.append(landed.timeline)
        series.landed = landed
        await series.peer.release(landed.grant.grant_id)


async def _pull_once(series: _Series, cache: NodeCache, tokens: int, rep: int) -> None:
    """One pull of ``tokens`` tokens for ``series`` (rep 0 warms up and is not kept)."""
    if series.push:
        return await _push_once(series, cache, tokens, rep)
    grant = await series.peer.prefill(f"t{tokens}-{series.path}-{rep}", [1] * tokens)
    with cache.allocate(grant.request_id, cache.config.blocks_for_tokens(grant.prompt_len)) as allocation:
        t0 = time.perf_counter()
        landed = await series.peer.pull(grant, into=allocation, transport=series.transport, release=False)
        if cache.pool.device.type == "cuda":
            torch.cuda.synchronize(cache.pool.device)
        elapsed = time.perf_counter() - t0
        if rep:
            series.starts[grant.grant_id] = t0
            series.times.append(elapsed)
            series.timelines.append(landed.timeline)
        series.landed = landed
        await series.peer.release(grant.grant_id)


async def _connector_rows(args: dict, ucx_options: tuple, transports: tuple[Transport, ...], suffix: str) -> list[dict]:
    """The rows of one UCX configuration: pulls from a prefill node of our block size over ``transports``, and
    with ``args["prefill_block_size"]`` also over UCX (the gRPC stream without ucxx) from a second prefill node of
    that block size (staging and repack). The two nodes' pulls alternate, rep by rep, in this one decode
    process, so that what drifts over the run (the host's load, its clocks) weighs on both alike."""
    config = _config(args["layers"], args["block_size"], args["kpool"])
    layout = BlockLayout(config)
    other = args.get("prefill_block_size") or args["block_size"]
    recorder = HopRecorder().install() if args["hops"] else None
    prefills = [_start_prefill(args, ucx_options, args["block_size"], transports)]
    hetero = (Transport.UCX if Transport.UCX in transports else Transport.GRPC_STREAM,)
    if other != args["block_size"]:
        prefills.append(_start_prefill(args, ucx_options, other, hetero))
    cache = NodeCache(layout, num_blocks=config.blocks_for_tokens(max(args["tokens"])) + 2, num_rings=4,
                      device=args["decode_device"])
    node = await DecodeConnector(cache.pool, engine_id="bench-decode",
                                 config=ConnectorConfig(transfer_timeout_s=120, rpc_timeout_s=120, ucx_options=ucx_options),
                                 registry=CollectorRegistry(), transports=transports).start()
    peers = [await node.connect(f"127.0.0.1:{port}") for _, _, port in prefills]
    rows: list[tuple[dict, _Series]] = []
    for tokens in args["tokens"]:
        series = [_Series(f"connector {t.label}{suffix}", peers[0], t) for t in transports]
        if Transport.UCX in transports and peers[0].pushes:
            series.append(_Series(f"connector ucx{suffix} push", peers[0], Transport.UCX, push=True))
        if len(peers) > 1:
            series += [_Series(f"connector {t.label}{suffix} from {other}", peers[1], t) for t in hetero]
        for rep in range(args["reps"] + 1):
            for one in series:
                await _pull_once(one, cache, tokens, rep)
        for one in series:
            seconds = max(statistics.median(one.times), 1e-9)  # a push may expose nothing it can measure
            rows.append(({"tokens": tokens, "layers": args["layers"], "bytes": one.landed.nbytes, "path": one.path,
                          "gbps": one.landed.nbytes / seconds / 1e9, "ms": seconds * 1e3, "regions": one.landed.regions,
                          "phases_ms": {name: round(statistics.median(getattr(t, f"{name}_ms") for t in one.timelines),
                                                    3) for name in PHASES}}, one))
    await node.close()
    prefill_stamps, prefill_steps = [], []
    for proc, conn, _ in prefills:
        conn.send("stop")
        stamps, steps = conn.recv() if conn.poll(30) else ({}, {})
        prefill_stamps.append(stamps)
        prefill_steps.append(steps)
        proc.join(30)
    if recorder is not None:  # the prefill nodes' stamps come once they stop
        for row, one in rows:
            row["hops_ms"] = hop_offsets(one.starts, recorder.stamps, *prefill_stamps)
            row["prefill_steps"] = loop_steps(one.starts, "read", "send", *prefill_steps)
    return [row for row, _ in rows]


def _decode_proc(conn, args: dict, ucx_options: tuple, transports: tuple, suffix: str) -> None:
    rows = asyncio.run(_connector_rows(args, tuple(ucx_options), tuple(Transport(t) for t in transports), suffix))
    conn.send(rows)
    os._exit(0)  # skip the UCX worker's teardown (its peer is gone)


def connector_rows(args: dict, ucx_options: tuple, transports: tuple[Transport, ...], suffix: str = "") -> list[dict]:
    """Rows for each transport and request size, from a fresh decode process and prefill process."""
    conn, child = child_context().Pipe()
    # not a daemon: it starts the prefill process
    proc = start_child(_decode_proc, child, args, ucx_options, tuple(t.value for t in transports), suffix, daemon=False)
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"the decode benchmark process exited with {proc.exitcode} before sending its rows")
    rows = conn.recv()
    proc.join(60)
    return rows


def _run(args) -> tuple[list[dict], dict]:
    config = _config(args.layers, args.block_size, args.kpool)
    layout = BlockLayout(config)
    use_ucx = ucx_available() and not args.no_ucx
    prefill_device = "cuda:0" if args.device == "cuda" else "cpu"
    decode_device = ("cuda:1" if args.two_gpu else "cuda:0") if args.device == "cuda" else "cpu"
    nixl, nixl_reason = (None, "--no-nixl") if args.no_nixl else import_nixl()
    notes = {"nixl": "measured" if nixl else f"skipped: {nixl_reason}",
             "ucx": "measured" if use_ucx else ("skipped: --no-ucx" if args.no_ucx else "skipped: ucxx does not import")}
    if use_ucx:  # ucxx reads its progress mode from the environment: every row of this run used it
        notes["ucx progress"] = os.environ.get("UCXPY_PROGRESS_MODE", "thread (ucxx's default)")
    rows = []
    for tokens in args.tokens:
        nbytes = config.blocks_for_tokens(tokens) * layout.block_bytes
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=prefill_device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=decode_device)
        base = {"tokens": tokens, "layers": args.layers, "bytes": nbytes}
        label = "torch peer copy" if args.two_gpu else ("device copy" if args.device == "cuda" else "memcpy")
        rows.append(base | {"path": label, "gbps": copy_gbps(src, dst, args.reps)})
        del src, dst
        if args.device == "cpu":
            rows.append(base | {"path": "raw socket", "gbps": socket_stream_gbps(nbytes, args.reps)})
        rows.append(base | {"path": "raw grpc stream", "gbps": grpc_stream_gbps(nbytes, args.reps)})
        if use_ucx:  # the connector's UCX options and placement: what a pull costs above UCX's own send
            rows.append(base | {"path": "raw ucxx tag", "gbps": ucxx_tag_gbps(nbytes, args.reps, prefill_device,
                                                                             decode_device, UCX_NO_SHARED_MEMORY)})
            rows.append(base | {"path": "raw ucxx worker ep", "gbps": ucxx_tag_gbps(
                nbytes, args.reps, prefill_device, decode_device, UCX_NO_SHARED_MEMORY, UcxxEndpoint.WORKER_ADDRESS)})
        if nixl is not None:
            rows.append(base | {"path": "nixl read", "gbps": nixl_read_gbps(nbytes, args.reps, prefill_device, decode_device)})
    shared = dict(tokens=args.tokens, layers=args.layers, block_size=args.block_size, kpool=args.kpool, reps=args.reps,
                  prefill_device=prefill_device, decode_device=decode_device, hops=args.hops)
    hetero = dict(prefill_block_size=args.prefill_block_size)  # pulled beside the same-layout pulls, in turn
    if use_ucx:
        rows += connector_rows(shared | hetero, UCX_NO_SHARED_MEMORY, (Transport.UCX, Transport.GRPC_STREAM))
        if args.device == "cpu":  # host memory on one host: the shared-memory and cma configuration too
            rows += connector_rows(shared, UCX_SAME_HOST_ZERO_COPY, (Transport.UCX,), " shm")
    else:
        rows += connector_rows(shared | hetero, UCX_NO_SHARED_MEMORY, (Transport.GRPC_STREAM,))
    order = {t: i for i, t in enumerate(args.tokens)}
    rows.sort(key=lambda r: order[r["tokens"]])  # stable: paths keep their order within a size
    return rows, notes


def loop_steps(starts: dict[str, float], first: str, last: str, *steps: dict[str, dict[str, int]]) -> int | None:
    """Median loop steps the pulls of ``starts`` took from hop ``first`` to hop ``last`` on a node that counted
    them (``HopRecorder.steps``), or None where none was counted."""
    counts = [process[g][last] - process[g][first] for g in starts for process in steps
              if first in process.get(g, {}) and last in process.get(g, {})]
    return round(statistics.median(counts)) if counts else None


def _step_lines(rows: list[dict]) -> str:
    """Per row with counted steps: the prefill node's loop steps from reading the pull to posting its first send."""
    lines = ["the prefill node's event loop steps from reading a pull to posting its first send (median; each step a "
             "hand-over between tasks or callbacks; gRPC's own steps before the read are not counted)"]
    lines += [f"{r['tokens']:>7} {r['path']:<20} {r['prefill_steps']}" for r in rows if r.get("prefill_steps") is not None]
    return "\n".join(lines)


def _table(rows: list[dict]) -> str:
    """One line per row, with its rate over the copy baseline, the raw socket, the raw gRPC stream, the
    raw ucxx tag send and NIXL READ of the same request size (a dash where that baseline was not measured)."""
    def rates(path_names):
        return {r["tokens"]: r["gbps"] for r in rows if r["path"] in path_names}
    baselines = [("x copy", rates(("memcpy", "device copy", "torch peer copy"))), ("x socket", rates(("raw socket",))),
                 ("x grpc", rates(("raw grpc stream",))), ("x ucxx", rates(("raw ucxx tag",))),
                 ("x nixl", rates(("nixl read",)))]
    lines = [f"{'tokens':>7} {'MiB':>8} {'path':<20} {'ms':>9} {'GB/s':>7}" + "".join(f" {n:>8}" for n, _ in baselines)
             + "  where a connector pull's time went (ms, median): " + " / ".join(PHASES)]
    for r in rows:
        ms = r.get("ms", r["bytes"] / r["gbps"] / 1e6)
        ratios = "".join(f" {r['gbps'] / b[r['tokens']]:8.2f}" if r["tokens"] in b else f" {'-':>8}" for _, b in baselines)
        phases = "  " + " / ".join(f"{r['phases_ms'][name]:.3f}" for name in PHASES) if "phases_ms" in r else ""
        lines.append(f"{r['tokens']:>7} {r['bytes'] / 2**20:8.1f} {r['path']:<20} {ms:9.3f} {r['gbps']:7.2f}{ratios}{phases}")
    return "\n".join(lines)


def _heterogeneous_lines(rows: list[dict], prefill_block_size: int, block_size: int) -> str:
    """Per request size: the pull from prefill blocks of another size (staging and repack included)
    over the same pull between equal layouts, measured in the same run."""
    lines = [f"pull from {prefill_block_size}-token prefill blocks into {block_size}-token decode blocks, "
             f"time over the same-layout pull:"]
    for r in rows:
        if r["path"].endswith(f" from {prefill_block_size}"):
            same = next((s for s in rows if s["tokens"] == r["tokens"] and s["path"] == r["path"].rsplit(" from ", 1)[0]),
                        None)
            ratio = f"{r['ms'] / same['ms']:.2f}x" if same else "-"
            lines.append(f"{r['tokens']:>7} tokens: {r['ms']:.3f} ms vs {same['ms'] if same else float('nan'):.3f} ms = "
                         f"{ratio} (repack {r['phases_ms'].get('verify', 0):.3f} ms)")
    return "\n".join(lines)


def _plot(rows: list[dict], path: Path, title: str) -> bool:
    """Draw GB/s against request size, one line a path; False (nothing written) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["path"] for r in rows):
        pts = [(r["bytes"] / 2**20, r["gbps"]) for r in rows if r["path"] == name]
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("request size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("kpool-pd bench transfer", __doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where both nodes' pools live (default cpu)")
    parser.add_argument("--two-gpu", action="store_true", help="decode pool on cuda:1 (prefill on cuda:0); needs --device cuda")
    parser.add_argument("--tokens", type=counts, default=[256, 1024, 4096, 16384, 32768, 65536, 131072],
                        help="request sizes in tokens, comma-separated (default 256,1024,4096,16384,32768,65536,131072)")
    parser.add_argument("--layers", type=count, default=4, help="model layers in each block (default 4)")
    parser.add_argument("--block-size", type=count, default=256, help="tokens per block (default 256)")
    parser.add_argument("--prefill-block-size", type=int, default=0,
                        help="also pull from a prefill node of this block size into --block-size decode blocks "
                             "(staging and repack), beside the same-layout pull (default 0: not)")
    parser.add_argument("--kpool", type=count, default=4, help="tokens per kpool pool (default 4)")
    parser.add_argument("--reps", type=count, default=5, help="timed pulls of each size and transport, the median "
                                                              "reported (default 5)")
    parser.add_argument("--no-ucx", action="store_true", help="measure the gRPC stream only")
    parser.add_argument("--no-nixl", action="store_true", help="leave the NIXL READ baseline out")
    parser.add_argument("--hops", action="store_true", help="also stamp each pull's hops on both nodes and print "
                                                            "where its time went, hop by hop (bench.pull_hops)")
    parser.add_argument("--machine", default=platform.node() or "machine", help="name in the result file names")
    parser.add_argument("--out", type=Path, default=Path("bench/results"),
                        help="folder for the JSON and PNG results (default bench/results)")
    return parser


GRPC_VERBOSITY = "ERROR"  # the bench's processes: gRPC's informational lines (a "Got goaway" as a node stops) stay quiet


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Before any child process starts (each takes this environment): a user's GRPC_VERBOSITY still wins.
    os.environ.setdefault("GRPC_VERBOSITY", GRPC_VERBOSITY)
    if args.two_gpu and args.device != "cuda":
        parser.error("--two-gpu needs --device cuda")
    try:  # a block size that kpool or the ring does not allow fails here, before any process starts
        _config(args.layers, args.block_size, args.kpool)
        if args.prefill_block_size:
            _config(args.layers, args.prefill_block_size, args.kpool)
    except ValueError as exc:
        parser.error(str(exc))
    if args.device == "cuda" and torch.cuda.device_count() < (2 if args.two_gpu else 1):
        parser.error(f"--device cuda{' --two-gpu' if args.two_gpu else ''} needs {(2 if args.two_gpu else 1)} GPUs; "
                     f"{torch.cuda.device_count()} visible")
    rows, notes = _run(args)
    for what, note in notes.items():
        sys.stdout.write(f"{what}: {note}\n")
    sys.stdout.write(_table(rows) + "\n")
    if args.hops:
        sys.stdout.write(hop_lines(rows) + "\n")
        sys.stdout.write(_step_lines(rows) + "\n")
    if args.prefill_block_size and args.prefill_block_size != args.block_size:
        sys.stdout.write(_heterogeneous_lines(rows, args.prefill_block_size, args.block_size) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"transfer-{dt.date.today().isoformat()}-{args.machine}-{args.device}{'-2gpu' if args.two_gpu else ''}"
    meta = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": args.machine, "device": args.device,
            "two_gpu": args.two_gpu, "layers": args.layers, "block_size": args.block_size,
            "prefill_block_size": args.prefill_block_size or args.block_size, "kpool": args.kpool,
            "reps": args.reps, "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "notes": notes}
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    drawn = _plot(rows, args.out / f"{stem}.png", f"kpool-pd transfer, {args.machine} ({args.device})")
    sys.stdout.write(wrote(args.out / f"{stem}.json", drawn) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
