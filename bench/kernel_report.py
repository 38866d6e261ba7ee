"""The kernel bench's report: the printed table and the PNG of times and fractions of copy bandwidth."""

from __future__ import annotations

from pathlib import Path


def format_table(rows: list[dict], copy_bps: float, device_name: str) -> str:
    lines = [f"device: {device_name}; copy bandwidth (read + write): {copy_bps / 1e12:.2f} TB/s",
             f"{'kernel':<46} {'size':<46} {'time us':>9} {'GB/s':>8} {'% copy':>7} {'target':<18} {'met':<4} anchor"]
    for r in rows:
        met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
        lines.append(f"{r['kernel']:<46} {r['size']:<46} {r['time_us']:>9.2f} {r['bandwidth_GBps']:>8.0f} "
                     f"{100 * r['fraction_of_copy']:>6.1f}% {r['target']:<18} {met:<4} {r['anchor']}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 0.45 * len(rows) + 2))
    names = [r["kernel"] for r in rows][::-1]
    left.barh(names, [r["time_us"] for r in rows][::-1], color="tab:blue")
    left.set_xscale("log")
    left.set_xlabel("time per call, us (log)")
    right.barh(names, [100 * r["fraction_of_copy"] for r in rows][::-1], color="tab:green")
    right.axvline(100, color="black", linewidth=1)
    right.set_xlabel("achieved bandwidth, % of device copy")
    right.set_yticks([])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
