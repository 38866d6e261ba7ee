"""Fleet benchmark: N prefill and M decode daemons of the project on one host (CPU, the tiny synthetic model),
concurrent clients sending skewed prompt lengths, the decode daemons' prefill choice round robin beside
least loaded, and least loaded under a balanced workload of the same mean prompt length beside the skewed
one; then every prefill daemon killed and restarted under load.

    kpool-pd bench fleet [--prefill 8] [--decode 8] [--clients 32] [--requests 10000] [--restart-requests 1000]
                         [--out bench/results]

Checks (``kpool_pd.bench.fleet_run``): every reply equals the colocated run byte for byte, no node holds a
block, ring, grant, queued prompt or expired lease after a phase, each decode daemon answers SERVING within
``--recover-s`` of the restarted prefill daemons being ready, no request sent after the kill fails. Target:
p99 time to first token of the skewed workload within 1.5x of the balanced one (both least loaded), with
round robin's beside it. Prints a table with the ratios, writes fleet-<date>-<machine>.json under --out;
exits 1 when a check failed or the target was missed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path

from kpool_pd.bench.arguments import bench_parser, count
from kpool_pd.bench.fleet_load import Workload
from kpool_pd.bench.fleet_nodes import NodeSizes
from kpool_pd.bench.fleet_run import FleetSpec, run_fleet, skew_ratio

SKEW_TARGET = 1.5


def table(phases: list[dict]) -> str:
    rows = [f"{'phase':<24} {'ok':>6} {'failed':>6} {'differ':>6} {'p50 ttft ms':>11} {'p99 ttft ms':>11} "
            f"{'req/s':>7}  prefill picks"]
    for p in phases:
        picks = p.get("picks_per_prefill")
        rows.append(f"{p['phase']:<24} {p['ok']:>6} {p['failed']:>6} {p['mismatched']:>6} {p['ttft_p50_ms']:>11.1f} "
                    f"{p['ttft_p99_ms']:>11.1f} {p['requests_per_s']:>7.1f}  "
                    f"{'min ' + str(int(min(picks))) + ' max ' + str(int(max(picks))) if picks else ''}")
    by = {p["phase"]: p for p in phases}
    ratio = skew_ratio(phases)
    if ratio is not None:
        rows.append(f"p99 ttft skewed / balanced (least-loaded): {ratio:.2f}x (target <= {SKEW_TARGET}x)")
    if "round-robin/skewed" in by and "least-loaded/skewed" in by and by["least-loaded/skewed"]["ttft_p99_ms"]:
        rows.append(f"p99 ttft skewed, round-robin / least-loaded: "
                    f"{by['round-robin/skewed']['ttft_p99_ms'] / by['least-loaded/skewed']['ttft_p99_ms']:.2f}x")
    if "restart" in by:
        r = by["restart"]
        rows.append(f"restart: prefill daemons down {r['restart_s']:.1f} s; decode SERVING after they were ready: "
                    f"max {max(r['decode_serving_after_ready_s'].values()):.2f} s; failed in flight "
                    f"{r['failed_in_flight']}, after the kill {r['failed_after_kill']}")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("kpool-pd bench fleet", __doc__)
    parser.add_argument("--prefill", type=count, default=8, help="prefill daemons (default 8)")
    parser.add_argument("--decode", type=count, default=8, help="decode daemons (default 8)")
    parser.add_argument("--clients", type=count, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--requests", type=count, default=10_000, help="requests per workload phase (default 10000)")
    parser.add_argument("--restart-requests", type=int, default=1_000,
                        help="requests of the restart phase (0: no restart; default 1000)")
    parser.add_argument("--distinct", type=count, default=256, help="distinct prompts the requests cycle over")
    parser.add_argument("--max-tokens", type=count, default=4, help="output tokens per request (default 4)")
    parser.add_argument("--long-share", type=float, default=0.1, help="share of long prompts (default 0.1)")
    parser.add_argument("--health-interval-s", type=float, default=0.5,
                        help="the decode daemons' prefill health checks, which carry the load (default 0.5)")
    parser.add_argument("--recover-s", type=float, default=5.0, help="decode SERVING after the restart, at most")
    parser.add_argument("--machine", default=platform.node() or "machine", help="name in the result file name")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder of the JSON result")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = FleetSpec(prefill=args.prefill, decode=args.decode, clients=args.clients,
                     workload=Workload(requests=args.requests, distinct=args.distinct, max_tokens=args.max_tokens,
                                       long_share=args.long_share),
                     restart_requests=args.restart_requests, recover_s=args.recover_s,
                     sizes=NodeSizes(health_interval_s=args.health_interval_s))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kpool-fleet-") as workdir:
        phases, problems = run_fleet(spec, Path(workdir))
    ratio = skew_ratio(phases)
    missed = [] if ratio is None or ratio <= SKEW_TARGET else [
        f"p99 time to first token skewed / balanced is {ratio:.2f}x, over the {SKEW_TARGET}x target"]
    sys.stdout.write(table(phases) + "\n")
    for line in problems + missed:
        sys.stdout.write(f"FAILED: {line}\n")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fleet-{dt.date.today().isoformat()}-{args.machine}.json"
    meta = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": args.machine,
            "command": "kpool-pd bench fleet " + " ".join(argv if argv is not None else sys.argv[1:]),
            "seconds": round(time.monotonic() - started, 1), **spec.describe()}
    path.write_text(json.dumps({"meta": meta, "phases": phases, "skew_ratio": ratio, "problems": problems,
                                "missed": missed}, indent=1) + "\n")
    sys.stdout.write(f"wrote {path}\n")
    return 1 if problems or missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
