"""The kernel bench's report: the printed table and the PNG of times and fractions of copy bandwidth."""

from __future__ import annotations

from pathlib import Path

from kpool_pd.bench.plotting import pyplot

METHODS = {"throughput": "1 call", "graph32": "32 in a graph", "flush1": "1, L2 flushed"}


def format_table(rows: list[dict], copy_bps: float, device_name: str) -> str:
    lines = [f"device: {device_name}; copy bandwidth (read + write): {copy_bps / 1e12:.2f} TB/s",
             "methods: '32 in a graph' = 32 calls captured in one CUDA graph, time per call; '1, L2 flushed' = one "
             "call a graph replay, L2 flushed before each; '1 call' = one call a replay (L2 flushed where the bytes "
             "fit in it)",
             f"{'kernel':<44} {'size':<44} {'method':<14} {'time us':>9} {'GB/s':>7} {'% copy':>7} {'target':<16} "
             f"{'met':<4} anchor"]
    for r in rows:
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        lines.append(f"{r['kernel']:<44} {r['size']:<44} {METHODS.get(r['method'], r['method']):<14} "
                     f"{r['time_us']:>9.2f} {r['bandwidth_GBps']:>7.0f} {100 * r['fraction_of_copy']:>6.1f}% "
                     f"{r['target']:<16} {met:<4} {r['anchor']}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """Draw each case's time and its fraction of copy; False (nothing written) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 0.42 * len(rows) + 2))
    names = [f"{r['kernel']} [{METHODS.get(r['method'], r['method'])}]" for r in rows][::-1]
    colors = ["tab:green" if r["met"] else ("tab:red" if r["met"] is False else "tab:blue") for r in rows][::-1]
    left.barh(names, [r["time_us"] for r in rows][::-1], color=colors)
    left.set_xscale("log")
    left.set_xlabel("time per call, us (log); green: target met, red: missed")
    right.barh(names, [100 * r["fraction_of_copy"] for r in rows][::-1], color="tab:gray")
    right.axvline(100, color="black", linewidth=1)
    right.set_xlabel("achieved bandwidth, % of device copy")
    right.set_yticks([])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
