"""``kpool-pd up`` over block-size pairs, families, pool sizes, drafts and transports: each run's
requests must equal the colocated run with the decode block size, byte for byte.

    python -m kpool_pd.bench.heterogeneous_sweep [--pairs 128:256,512:128,256:512] [--drafts 0,1,2,3,4,5]
        [--transports ucx,grpc] [--requests 2 --prompt-len 600 --max-tokens 8] [--out FILE.json]

A combination whose ring (kpool family) or group ring (QSA) does not divide both block sizes, or whose
blocks are a geometry the daemons refuse (kpool 8 in 128-token blocks: pages of 16 states), is
listed as not applicable (the daemons would refuse it at start). Prints one line per run as it
ends (progress on stderr), then a table of the outcomes; exits 1 when any applicable run failed
or did not match.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

from kpool_pd.bench.arguments import bench_parser
from kpool_pd.kvcache import CacheFamily, family_spec_type
from kpool_pd.model import ModelConfig
from kpool_pd.runtime.geometry import check_serving_geometry

logger = logging.getLogger("kpool_pd.sweep")
FAMILY_GROUPS = (("kpool", 2), ("kpool", 4), ("kpool", 8), ("qsa", 2), ("qsa", 4), ("qsa", 8))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        a, _, b = item.partition(":")
        pairs.append((int(a), int(b)))
    return pairs


def applicable(family: str, group: int, drafts: int, sizes: tuple[int, int]) -> bool:
    """Whether the ring (or QSA's group ring) and the group divide both block sizes, and both blocks
    are a geometry the daemons serve (``kpool_pd.runtime.geometry``: kpool 8 in 128-token blocks is not)."""
    ring = family_spec_type(CacheFamily(family)).ring_slots_for(group, drafts)
    if not all(size % ring == 0 and size % group == 0 for size in sizes):
        return False
    try:
        for size in sizes:
            check_serving_geometry(ModelConfig.build(family=CacheFamily(family), kpool=group, compress_ratio=group,
                                                     num_spec=drafts, block_size=size).cache)
    except ValueError:
        return False
    return True


def run_one(family: str, group: int, drafts: int, sizes: tuple[int, int], transport: str, args) -> dict:
    """One ``kpool-pd up --json`` run; its summary with the outcome."""
    key = "--kpool" if family == "kpool" else "--ratio"
    command = [sys.executable, "-m", "kpool_pd", "up", "--json", "--family", family, key, str(group), "--num-spec",
               str(drafts), "--prefill-block-size", str(sizes[0]), "--decode-block-size", str(sizes[1]),
               "--transport", transport, "--requests", str(args.requests), "--prompt-len", str(args.prompt_len),
               "--max-tokens", str(args.max_tokens)]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    summary = rows[-1].get("summary", {}) if rows else {}
    return {"family": family, "group": group, "drafts": drafts, "prefill_block": sizes[0], "decode_block": sizes[1],
            "transport": transport, "code": proc.returncode, "ok": summary.get("ok", 0),
            "match": summary.get("colocated_match", 0), "requests": args.requests,
            "seconds": round(time.perf_counter() - started, 1),
            "error": "" if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1:]}


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("python -m kpool_pd.bench.heterogeneous_sweep", __doc__)
    parser.add_argument("--pairs", type=_pairs, default=_pairs("128:256,512:128,256:512"),
                        help="prefill:decode block sizes (default 128:256,512:128,256:512)")
    parser.add_argument("--drafts", type=_ints, default=_ints("0,1,2,3,4,5"),
                        help="draft counts, comma-separated (default 0,1,2,3,4,5)")
    parser.add_argument("--transports", default="ucx,grpc", help="data planes, comma-separated (default ucx,grpc)")
    parser.add_argument("--requests", type=int, default=2, help="requests of each run (default 2)")
    parser.add_argument("--prompt-len", type=int, default=600, help="prompt tokens of each request (default 600)")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens of each request (default 8)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="deadline of one run (default 300)")
    parser.add_argument("--out", type=Path, default=None, help="write every run's outcome as JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    plan = [(f, g, d, sizes, t) for sizes in args.pairs for f, g in FAMILY_GROUPS for d in args.drafts
            for t in args.transports.split(",")]
    runs, skipped = [], 0
    for i, (family, group, drafts, sizes, transport) in enumerate(plan, 1):
        if not applicable(family, group, drafts, sizes):
            skipped += 1
            continue
        run = run_one(family, group, drafts, sizes, transport, args)
        runs.append(run)
        logger.info("[%d/%d] %s %d, %d drafts, %d -> %d, %s: %d/%d ok, %d match (%.0f s)%s", i, len(plan), family, group,
                    drafts, *sizes, transport, run["ok"], run["requests"], run["match"], run["seconds"],
                    f" {run['error']}" if run["error"] else "")
    good = [r for r in runs if r["code"] == 0 and r["ok"] == r["match"] == r["requests"]]
    sys.stdout.write(f"{len(good)} of {len(runs)} runs equal the colocated run byte for byte "
                     f"({skipped} combinations not applicable: the ring or group does not divide a block size)\n")
    for r in runs:
        if r not in good:
            sys.stdout.write(f"  FAILED: {r}\n")
    if args.out:
        args.out.write_text(json.dumps({"argv": sys.argv[1:], "runs": runs, "not_applicable": skipped}, indent=1) + "\n")
    return 0 if len(good) == len(runs) and runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
