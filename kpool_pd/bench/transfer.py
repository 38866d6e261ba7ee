"""Transfer benchmark: time from Pull to the last byte landed, per transport and request size,
beside baselines measured in the same run (memcpy of the same bytes; a raw loopback TCP stream
between two processes; a raw gRPC stream between two processes (``kpool_pd.bench.grpc_baseline``); torch's
peer copy when two GPUs are used; a raw ucxx tag send of the same bytes between two processes, with the
connector's UCX options and placement, where ucxx imports (``kpool_pd.bench.ucxx_baseline``: over a listener's
connection, the ratio's baseline, and over the connector's kind of endpoint; and the same bytes in as many tagged
messages as a connector series sent a pull, or as --ucxx-messages asks, beside the one-message send); NIXL READ
of the same bytes across two processes where the nixl package imports). The ``msgs`` column gives each UCX row's
messages a pull, ``x ucxxK`` its rate over the raw send in as many messages.

    python -m kpool_pd.bench.transfer [--device cpu|cuda] [--two-gpu] [--tokens 1024,4096,...] [--out DIR]

The connector's rows come from ``kpool_pd.bench.transfer_connector``. Each UCX configuration runs with fresh
processes (UCX reads its options once per process): the decode node in one child process, the prefill node in
another (``kpool_pd.runtime.launch``); with --prefill-block-size a second prefill node of that block size, whose
pulls alternate with the first one's in the same decode process. The baselines live in
``kpool_pd.bench.transfer_baselines``. On the CPU machine both same-host UCX configurations are measured (see
ConnectorConfig.ucx_options).
Prints a table, writes transfer-<date>-<machine>.json (and a .png when matplotlib imports) under --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path

import torch

from kpool_pd.bench.arguments import bench_parser, count, counts
from kpool_pd.bench.grpc_baseline import grpc_stream_gbps
from kpool_pd.bench.plotting import pyplot, wrote
from kpool_pd.bench.pull_hops import hop_lines
from kpool_pd.bench.transfer_baselines import copy_gbps, import_nixl, nixl_read_gbps, socket_stream_gbps
from kpool_pd.bench.transfer_connector import PHASES, bench_config, connector_rows
from kpool_pd.bench.ucxx_baseline import UcxxEndpoint, ucxx_tag_gbps
from kpool_pd.connector import (UCX_NO_SHARED_MEMORY, UCX_SAME_HOST_ZERO_COPY, Transport, UcxProgress,
                               describe_progress_mode, ucx_available)
from kpool_pd.kvcache import BlockLayout

RAW_UCXX = "raw ucxx tag"  # one message: the "x ucxx" column's baseline


def raw_ucxx_path(messages: int) -> str:
    """The row name of the raw ucxx send of a size's bytes as ``messages`` tagged messages."""
    return RAW_UCXX if messages == 1 else f"{RAW_UCXX} x{messages}"


def _raw_ucxx_rows(base: dict, args, devices: tuple[str, str], counts_: set[int]) -> list[dict]:
    """The raw ucxx sends of ``base``'s bytes in each of ``counts_`` messages (over a listener's connection)."""
    return [base | {"path": raw_ucxx_path(k), "messages": k,
                    "gbps": ucxx_tag_gbps(base["bytes"], args.reps, *devices, UCX_NO_SHARED_MEMORY, messages=k)}
            for k in sorted(counts_) if k <= base["bytes"]]


def _run(args) -> tuple[list[dict], dict]:
    config = bench_config(args.layers, args.block_size, args.kpool)
    layout = BlockLayout(config)
    use_ucx = ucx_available() and not args.no_ucx
    prefill_device = "cuda:0" if args.device == "cuda" else "cpu"
    decode_device = ("cuda:1" if args.two_gpu else "cuda:0") if args.device == "cuda" else "cpu"
    nixl, nixl_reason = (None, "--no-nixl") if args.no_nixl else import_nixl()
    notes = {"nixl": "measured" if nixl else f"skipped: {nixl_reason}",
             "ucx": "measured" if use_ucx else ("skipped: --no-ucx" if args.no_ucx else "skipped: ucxx does not import")}
    if use_ucx:  # every UCX row of this run (the connector's and the raw baselines') progressed its worker so
        notes["ucx progress"] = describe_progress_mode(UcxProgress.AUTO, args.device)
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
            rows += _raw_ucxx_rows(base, args, (prefill_device, decode_device), {1, *args.ucxx_messages})
            rows.append(base | {"path": "raw ucxx worker ep", "messages": 1, "gbps": ucxx_tag_gbps(
                nbytes, args.reps, prefill_device, decode_device, UCX_NO_SHARED_MEMORY, UcxxEndpoint.WORKER_ADDRESS)})
        if nixl is not None:
            rows.append(base | {"path": "nixl read", "gbps": nixl_read_gbps(nbytes, args.reps, prefill_device, decode_device)})
    shared = dict(tokens=args.tokens, layers=args.layers, block_size=args.block_size, kpool=args.kpool, reps=args.reps,
                  prefill_device=prefill_device, decode_device=decode_device, hops=args.hops,
                  prefill_ms=args.prefill_ms, prefill_chunk=args.prefill_chunk)
    hetero = dict(prefill_block_size=args.prefill_block_size)  # pulled beside the same-layout pulls, in turn
    if use_ucx:
        rows += connector_rows(shared | hetero, UCX_NO_SHARED_MEMORY, (Transport.UCX, Transport.GRPC_STREAM))
        if args.device == "cpu":  # host memory on one host: the shared-memory and cma configuration too
            rows += connector_rows(shared, UCX_SAME_HOST_ZERO_COPY, (Transport.UCX,), " shm")
    else:
        rows += connector_rows(shared | hetero, UCX_NO_SHARED_MEMORY, (Transport.GRPC_STREAM,))
    if use_ucx:  # beside each UCX series of several messages a pull: the raw send of its bytes in as many
        for tokens in args.tokens:
            used = {r["messages"] for r in rows if r["tokens"] == tokens and r.get("messages")}
            measured = {r["messages"] for r in rows if r["tokens"] == tokens and r["path"].startswith(RAW_UCXX)}
            base = next({"tokens": tokens, "layers": args.layers, "bytes": r["bytes"]} for r in rows
                        if r["tokens"] == tokens and r["path"] == RAW_UCXX)
            rows += _raw_ucxx_rows(base, args, (prefill_device, decode_device), used - measured)
    order = {t: i for i, t in enumerate(args.tokens)}
    rows.sort(key=lambda r: order[r["tokens"]])  # stable: paths keep their order within a size
    return rows, notes


def _stated_lines(rows: list[dict]) -> str:
    """Per push row: its exposed time on the one clock (the row's ms) beside what the decode node stated
    (``TransferTimes``, which leaves PrefillDone's way across out); empty without push rows."""
    pushes = [r for r in rows if "stated_ms" in r]
    if not pushes:
        return ""
    lines = ["a push's exposed time (median ms): the prompt written to every byte received, on the one clock of both "
             "processes, beside what the decode node states (TransferTimes: PrefillDone's way across left out)"]
    lines += [f"{r['tokens']:>7} {r['path']:<20} {r['ms']:.3f} one clock, {r['stated_ms']:.3f} stated" for r in pushes]
    return "\n".join(lines)


def _step_lines(rows: list[dict]) -> str:
    """Per row with counted steps: the prefill node's loop steps from reading the pull to posting its first send."""
    lines = ["the prefill node's event loop steps from reading a pull to posting its first send (median; each step a "
             "hand-over between tasks or callbacks; gRPC's own steps before the read are not counted)"]
    lines += [f"{r['tokens']:>7} {r['path']:<20} {r['prefill_steps']}" for r in rows if r.get("prefill_steps") is not None]
    return "\n".join(lines)


def _table(rows: list[dict]) -> str:
    """One line per row: its UCX messages a pull (``msgs``: a tagged message a region; a dash for the gRPC
    stream and the baselines of another kind), its rate over the copy baseline, the raw socket, the raw gRPC
    stream, the raw ucxx tag send in one message and NIXL READ of the same request size, and over the raw ucxx
    send of the same bytes in as many messages as the row's (``x ucxxK``); a dash where that baseline was not
    measured."""
    def rates(path_names):
        return {r["tokens"]: r["gbps"] for r in rows if r["path"] in path_names}
    baselines = [("x copy", rates(("memcpy", "device copy", "torch peer copy"))), ("x socket", rates(("raw socket",))),
                 ("x grpc", rates(("raw grpc stream",))), ("x ucxx", rates((RAW_UCXX,))),
                 ("x nixl", rates(("nixl read",)))]
    same_count = {(r["tokens"], r["messages"]): r["gbps"] for r in rows if r["path"].startswith(RAW_UCXX)}
    lines = [f"{'tokens':>7} {'MiB':>8} {'path':<20} {'msgs':>5} {'ms':>9} {'GB/s':>7}"
             + "".join(f" {n:>8}" for n, _ in baselines) + f" {'x ucxxK':>8}"
             + "  where a connector pull's time went (ms, median): " + " / ".join(PHASES)]
    for r in rows:
        ms = r.get("ms", r["bytes"] / r["gbps"] / 1e6)
        ratios = "".join(f" {r['gbps'] / b[r['tokens']]:8.2f}" if r["tokens"] in b else f" {'-':>8}" for _, b in baselines)
        k = (r["tokens"], r.get("messages"))
        ratios += f" {r['gbps'] / same_count[k]:8.2f}" if k in same_count else f" {'-':>8}"
        messages = f"{r['messages']:>5}" if r.get("messages") else f"{'-':>5}"
        phases = "  " + " / ".join(f"{r['phases_ms'][name]:.3f}" for name in PHASES) if "phases_ms" in r else ""
        lines.append(f"{r['tokens']:>7} {r['bytes'] / 2**20:8.1f} {r['path']:<20} {messages} {ms:9.3f} {r['gbps']:7.2f}"
                     f"{ratios}{phases}")
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
            op = r.get("repack_op")
            within = (f"; its op {op['wall_ms']:.3f} ms, {op['cpu_ms']:.3f} ms of its thread's CPU" if op else "")
            lines.append(f"{r['tokens']:>7} tokens: {r['ms']:.3f} ms vs {same['ms'] if same else float('nan'):.3f} ms = "
                         f"{ratio} (repack {r['phases_ms'].get('verify', 0):.3f} ms{within})")
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
    parser.add_argument("--ucxx-messages", type=counts, default=[],
                        help="also send each size's bytes raw in this many ucxx tagged messages, comma-separated "
                             "(e.g. 8,61,183); the counts a connector series used are measured anyway (default none)")
    parser.add_argument("--prefill-ms", type=float, default=5.0,
                        help="the prefill nodes' modelled compute time a prompt, between their engine serving its "
                             "blocks and writing them; a push's sends wait on it as behind a real prefill "
                             "(default 5)")
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="the prefill nodes write a prompt in chunks of this many tokens, each after its share "
                             "of --prefill-ms, as a chunked prefill does (a push moves in pieces of a chunk, "
                             "the later ones behind the later chunks); default 0: the whole prompt at once (a "
                             "push is one piece, as kpool-pd prefill-worker sets it for a prompt computed whole)")
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
    if args.prefill_ms < 0 or args.prefill_chunk < 0:
        parser.error(f"--prefill-ms and --prefill-chunk must be >= 0, got {args.prefill_ms} and {args.prefill_chunk}")
    if args.two_gpu and args.device != "cuda":
        parser.error("--two-gpu needs --device cuda")
    try:  # a block size that kpool or the ring does not allow fails here, before any process starts
        bench_config(args.layers, args.block_size, args.kpool)
        if args.prefill_block_size:
            bench_config(args.layers, args.prefill_block_size, args.kpool)
    except ValueError as exc:
        parser.error(str(exc))
    if args.device == "cuda" and torch.cuda.device_count() < (2 if args.two_gpu else 1):
        parser.error(f"--device cuda{' --two-gpu' if args.two_gpu else ''} needs {(2 if args.two_gpu else 1)} GPUs; "
                     f"{torch.cuda.device_count()} visible")
    rows, notes = _run(args)
    for what, note in notes.items():
        sys.stdout.write(f"{what}: {note}\n")
    sys.stdout.write(_table(rows) + "\n")
    if stated := _stated_lines(rows):
        sys.stdout.write(stated + "\n")
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
