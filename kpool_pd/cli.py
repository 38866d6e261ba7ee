"""`kpool-pd`: the command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _selfcheck(args: argparse.Namespace) -> int:
    from kpool_pd.selfcheck import DEFAULT_CASES, format_table, run_case

    rows = []
    started = time.perf_counter()
    for index, case in enumerate(DEFAULT_CASES, 1):
        print(f"[{index}/{len(DEFAULT_CASES)}] kpool {case.kpool}, {case.num_spec} drafts, "
              f"{case.prompt_len} -> {case.total_len} tokens ...", file=sys.stderr, flush=True)
        rows.append(run_case(case, seed=args.seed + index))
    print(format_table(rows))
    broken = sum(not row.holds for row in rows)
    print(f"\n{len(rows) - broken} of {len(rows)} configurations hold the invariant "
          f"({time.perf_counter() - started:.1f} s)")
    return 1 if broken else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kpool-pd", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    commands = parser.add_subparsers(dest="command", required=True)
    selfcheck = commands.add_parser(
        "selfcheck", help="show the cache invariant: colocated prefill == prefix prefill + drafted decode"
    )
    selfcheck.add_argument("--seed", type=int, default=0, help="seed of keys and draft histories (default 0)")
    selfcheck.set_defaults(handler=_selfcheck)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.handler(args)
