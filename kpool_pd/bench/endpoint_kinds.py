"""Whether the kind of UCX endpoint costs a send anything by itself: the raw ucxx send of the same bytes between
two processes (``kpool_pd.bench.ucxx_baseline``, the connector's UCX options and placement) over each kind of
endpoint in turn, round after round, so that what drifts weighs on every kind alike:

- ``listener``: the receiver connects to the sender's listener (UCX's peer error handling on), request and
  bytes on that connection, the receive posted on the endpoint (the transfer bench's baseline);
- ``worker address``: as the connector makes them, from the peer's worker address with error handling off,
  the bytes under a forced tag into a receive posted on the worker before the request;
- ``worker address, error handling on``: the same with UCX's peer error handling.

    python -m kpool_pd.bench.endpoint_kinds --device cuda --mib 41,164,1313 --reps 9 --rounds 2
"""

from __future__ import annotations

import statistics
import sys

from kpool_pd.bench.arguments import bench_parser, count, counts
from kpool_pd.bench.ucxx_baseline import UcxxEndpoint, ucxx_tag_gbps
from kpool_pd.connector import UCX_NO_SHARED_MEMORY

MIB = 1 << 20


def measure(mib: list[int], reps: int, rounds: int, device: str) -> dict[tuple[int, UcxxEndpoint], list[float]]:
    """ms of each kind's send of each size (the median of ``reps`` a round), one value a round."""
    src, dst = ("cuda:0", "cuda:0") if device == "cuda" else ("cpu", "cpu")
    ms: dict[tuple[int, UcxxEndpoint], list[float]] = {}
    for round_ in range(rounds):
        for size in mib:
            for kind in UcxxEndpoint:
                gbps = ucxx_tag_gbps(size * MIB, reps, src, dst, UCX_NO_SHARED_MEMORY, kind)
                ms.setdefault((size, kind), []).append(size * MIB / gbps / 1e6)
                sys.stderr.write(f"round {round_ + 1}: {size} MiB over {kind.value}: {ms[size, kind][-1]:.3f} ms\n")
    return ms


def table(ms: dict[tuple[int, UcxxEndpoint], list[float]]) -> str:
    """One line per size: each kind's ms (median over rounds, then each round's) and its ratio to the listener's."""
    lines = [f"{'MiB':>6}  " + "  ".join(f"{kind.value:>34}" for kind in UcxxEndpoint)
             + "   (ms: median of rounds [each round]; x listener)"]
    for size in sorted({s for s, _ in ms}):
        base = statistics.median(ms[size, UcxxEndpoint.LISTENER])
        cells = []
        for kind in UcxxEndpoint:
            values = ms[size, kind]
            one = statistics.median(values)
            cells.append(f"{one:.3f} [{' '.join(f'{v:.3f}' for v in values)}] {one / base:.2f}x".rjust(34))
        lines.append(f"{size:>6}  " + "  ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("python -m kpool_pd.bench.endpoint_kinds", __doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both buffers live (cuda: cuda:0)")
    parser.add_argument("--mib", type=counts, default=[41, 164], help="sizes in MiB, comma-separated (default 41,164)")
    parser.add_argument("--reps", type=count, default=9, help="timed sends a size, kind and round (default 9)")
    parser.add_argument("--rounds", type=count, default=2, help="rounds over every size and kind (default 2)")
    args = parser.parse_args(argv)
    sys.stdout.write(table(measure(args.mib, args.reps, args.rounds, args.device)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
