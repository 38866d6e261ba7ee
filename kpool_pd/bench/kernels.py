"""Kernel benchmark on a CUDA device: time per kernel (CUDA graph replay, median of many) and achieved
bandwidth against this device's own copy bandwidth, measured in the same run. Every decode-time kernel is
timed two ways (32 calls captured in one graph, per call; one call a replay after an L2 flush), each with
its target and whether it is met (``kpool_pd.bench.timing`` says how). Prints a table; writes JSON, the table and a
PNG to --out.

    python kpool_pd/bench/kernels.py --out bench-out        # or: kpool-pd bench kernels --out bench-out

The cases live with their family (``kpool_pd.bench.kpool_cases.KPOOL_CASES``, ``kpool_pd.bench.qsa_cases.QSA_CASES``) or their op
(``kpool_pd.bench.repack_cases.REPACK_CASES``);
to add a kernel, append a ``BenchCase`` (``kpool_pd.bench.timing``) to its family's list.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import triton

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kpool_pd.bench.arguments import bench_parser, count  # noqa: E402
from kpool_pd.bench.copy_baseline import copy_bandwidths  # noqa: E402
from kpool_pd.bench.kernel_report import format_table, plot  # noqa: E402
from kpool_pd.bench.kpool_cases import KPOOL_CASES, KPOOL_VARIANTS  # noqa: E402
from kpool_pd.bench.qsa_cases import QSA_CASES, QSA_VARIANTS  # noqa: E402
from kpool_pd.bench.repack_cases import REPACK_CASES  # noqa: E402
from kpool_pd.bench.timing import BenchCase, run_cases  # noqa: E402

CASES: list[BenchCase] = [*KPOOL_CASES, *QSA_CASES, *REPACK_CASES]
VARIANTS: list[BenchCase] = [*KPOOL_VARIANTS, *QSA_VARIANTS]  # launch variants, with --variants


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("kpool-pd bench kernels", __doc__)
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for kernels.json/.txt/.png")
    parser.add_argument("--reps", type=count, default=200, help="timed graph replays per kernel (median reported)")
    parser.add_argument("--only", default="", help="run only the cases whose name contains one of these comma-separated texts")
    parser.add_argument("--variants", action="store_true", help="also time the kernels' launch variants (sweeps)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    wanted = [part for part in args.only.split(",") if part] or [""]
    cases = [c for c in CASES + (VARIANTS if args.variants else []) if any(part in c.name for part in wanted)]
    if not cases:
        parser.error(f"--only {args.only!r} names no case{'' if args.variants else ' (launch variants need --variants)'}")
    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA device (none found)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    device_name = torch.cuda.get_device_name(device)
    copies = copy_bandwidths(device)
    copy_name, copy_bps = max(copies.items(), key=lambda item: item[1])
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
